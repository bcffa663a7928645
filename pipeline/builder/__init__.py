"""The build side: prefix definition -> pinned render -> stability cut -> MLX prefill -> bundle."""
