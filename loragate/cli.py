"""The `loragate` command line: one entry point, subcommands import their heavy parts lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _models_make(args: argparse.Namespace) -> int:
    from worker.modelzoo.make import make_all

    paths = make_all(Path(args.out) if args.out else None, progress=not args.quiet)
    print(paths.root)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from loadtest.bench_engine import main as bench_main

    return bench_main(args.rest)


def _demo(args: argparse.Namespace) -> int:
    from worker.demo import main as demo_main

    return demo_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loragate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="build or inspect the demo checkpoints and adapters")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    make = models_sub.add_parser("make", help="build the demo base models, tokenizer and LoRA adapters")
    make.add_argument("--out", help="output directory (default: the loragate cache)")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    make.set_defaults(func=_models_make)

    bench = sub.add_parser("bench", help="benchmarks (last output line is one JSON object)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    engine = bench_sub.add_parser("engine", help="loragate engine vs transformers+peft", add_help=False)
    engine.add_argument("rest", nargs=argparse.REMAINDER)
    engine.set_defaults(func=_bench_engine)

    demo = sub.add_parser("demo", help="generate with the demo models and adapters", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
