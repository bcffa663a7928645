"""`new`: a first definition for a model, its template pinned, and its size in tokens."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import load_definitions


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    n = sub.add_parser(
        "new", parents=parents, help="write prefixes/NAME.toml for a model, template pinned"
    )
    n.add_argument("name", help="the prefix name (also the file name)")
    n.add_argument("--model", type=Path, required=True, help="the model folder it is built for")
    n.add_argument("--system-file", type=Path, help="the system prompt (default: a starter text)")
    n.add_argument("--tools", type=Path, help="OpenAI function tools, a JSON list")
    n.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.authoring import new_definition
    from pipeline.builder.prefill import encode
    from pipeline.builder.render import render_prefix

    path = new_definition(args.prefixes, args.name, args.model, args.system_file, args.tools)
    (definition,) = load_definitions(args.prefixes, [args.name])
    from mlx_lm.utils import load_tokenizer

    tokens = encode(load_tokenizer(Path(args.model)), render_prefix(definition, args.model).text)
    print(
        f"wrote {path} ({len(tokens):,} tokens for {args.model}); build it with 'python build.py build {args.name}'"
    )
    return 0
