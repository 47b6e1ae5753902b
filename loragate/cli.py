"""The `loragate` command line: one entry point; each subcommand imports its heavy parts lazily.

`worker`, `gateway`, `up`, `demo`, `bench engine`, `eval` and `models train-adapters` hand their arguments
to their own parsers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# subcommand words -> (module with `main(argv) -> int`, help)
PASSTHROUGH: dict[tuple[str, ...], tuple[str, str]] = {
    ("up",): ("loragate.up", "the embedded dev stack: Redis, a gateway and workers, in one command"),
    ("gateway",): ("gateway.main", "run the OpenAI-compatible gateway"),
    ("worker",): ("worker.main", "run a worker: engine + Redis queue consumer"),
    ("demo",): ("worker.demo", "generate with the demo models and adapters, in-process"),
    ("bench", "engine"): ("loadtest.bench_engine", "engine throughput: loragate vs transformers+peft"),
    ("policy",): ("policies.cli", "validate a policy file; train the difficulty estimator"),
    ("eval",): ("loragate.eval", "accuracy of the SmolLM2 adapters vs their base, through a running fleet"),
    ("models", "train-adapters"): (
        "worker.modelzoo.train_adapters",
        "train the SmolLM2 LoRA adapters of loragate.adapter_tasks (CPU)",
    ),
}


def _models_make(args: argparse.Namespace) -> int:
    from worker.modelzoo.make import make_all

    paths = make_all(Path(args.out) if args.out else None, progress=not args.quiet)
    print(paths.root)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragate",
        description="LoRA-aware LLM serving. Subcommands: "
        + "; ".join(f"{' '.join(words)}: {text}" for words, (_, text) in PASSTHROUGH.items()),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for words, (_, text) in PASSTHROUGH.items():
        if words[0] != "models":  # listed under `models` below
            sub.add_parser(words[0], help=text, add_help=False)
    models = sub.add_parser("models", help="build the demo checkpoints and adapters")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    for words, (_, text) in PASSTHROUGH.items():
        if words[0] == "models":
            models_sub.add_parser(words[1], help=text, add_help=False)
    make = models_sub.add_parser("make", help="build the demo base models, tokenizer and LoRA adapters")
    make.add_argument("--out", help="output directory (default: the loragate cache)")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    make.set_defaults(func=_models_make)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    for words, (module, _) in PASSTHROUGH.items():
        if tuple(args_list[: len(words)]) == words:
            entry: Callable[[list[str]], int] = importlib.import_module(module).main
            return entry(args_list[len(words) :])
    args = build_parser().parse_args(args_list)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
