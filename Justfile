# Prefix-cache bundles for MLX. `just` alone runs the tests and the linter.

set positional-arguments

default: test lint

# Generate the demo model if missing, build every example prefix, verify and mount the bundles.
demo:
    python build.py demo

# Build bundles (all definitions, or the names given): `just build support-agent`.
build *args:
    python build.py build "$@"

# The tests without the slow ones (no network, no GPU; the tiny model is generated on the fly).
# Run by pytest-xdist on up to 4 cores (`just test -n 0`: one process, e.g. to debug one test).
test *args:
    python -m pytest -m "not slow" -n auto --maxprocesses 4 "$@"

# Only the slow tests (real servers, both mlx-lm minors, the full fuzz sweep); CI runs both.
test-slow *args:
    python -m pytest -m slow -n auto --maxprocesses 4 "$@"

# Side-by-side benchmarks against mlx_lm; writes bench/RESULTS.md and a chart. `just bench --quick`.
bench *args:
    python bench/run.py "$@"

lint:
    ruff check pipeline tests bench examples build.py .github/scripts
    ruff format --check pipeline tests bench examples build.py .github/scripts
    @if command -v actionlint >/dev/null; then actionlint; else echo "actionlint not installed: .github/workflows not linted (pip install -e '.[lint]' where github.com is reachable)"; fi

fmt:
    ruff format pipeline tests bench examples build.py .github/scripts
    ruff check --fix pipeline tests bench examples build.py .github/scripts
