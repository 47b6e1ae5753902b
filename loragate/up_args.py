"""`loragate up`'s command line → the `StackConfig` to run (loragate.stack_config).

No flags: the default stack (`smollm2` on `--workers` workers with its shipped adapters, `tiny` for the
easy rung of `auto`); `--model DIR|smollm2`: that model alone; `-c FILE`: the stack file, with no other
flag (so file and command line cannot disagree). Flag values are checked by the stack file's own
validator and its messages renamed to the flag (`--workers: must be an integer ≥ 1, got 0`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from loragate.stack_config import StackConfig, StackError, load_stack, parse_stack

DESCRIPTION = "a whole serving stack in one command (Redis, a gateway, workers), mirroring compose.yaml"
DEFAULT_WORKERS = 2  # smollm2 workers of the default stack
DEFAULT_AUTO = ({"max_score": 0.4, "model": "tiny"}, {"model": "smollm2"})
# The stack key a command-line flag sets (so a bad value is reported under the flag's name).
_FLAG_OF = {"path": "--model", "name": "--model-name", "adapters": "--adapters", "workers": "--workers"}
_FLAG_OF |= {"device": "--device", "dtype": "--dtype", "kv_cache_mb": "--kv-cache-mb"}
_FLAG_OF |= {"port": "--port", "host": "--host"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loragate up", description=DESCRIPTION)
    p.add_argument(
        "-c", "--config", help="a stack file (see deploy/stack.example.yaml); no other flag with it"
    )
    p.add_argument("--model", help="serve this checkpoint directory (or smollm2) alone")
    p.add_argument("--model-name", help="the name clients use for --model (default: its directory name)")
    p.add_argument(
        "--adapters", help="PEFT adapters for --model, one per subfolder (served as NAME:subfolder)"
    )
    p.add_argument(
        "--workers", type=int, help=f"workers of the model (default {DEFAULT_WORKERS}; --model: 1)"
    )
    p.add_argument("--device", help="every worker's device: auto, cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--dtype", help="every worker's dtype: auto, float32, bfloat16, float16 (default: auto)")
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        help="every worker's KV cache in MiB (default: the worker's own, what its sequences need capped by "
        "the free memory)",
    )
    p.add_argument("--port", type=int, help="the gateway's port (default 8000)")
    p.add_argument("--host", help="the gateway's address (default 127.0.0.1)")
    return p


def stack_from_args(args: argparse.Namespace) -> StackConfig:
    """The stack the command line asks for; StackError names the file and key, or the flag."""
    values = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in _FLAG_OF.values()}
    given = [flag for flag, value in values.items() if value is not None]
    if args.config is not None:
        if given:
            raise StackError(
                f"{', '.join(given)}: cannot be combined with -c/--config {args.config}; set it in that file"
            )
        return load_stack(Path(args.config))
    if args.model is None and ("--model-name" in given or "--adapters" in given):
        raise StackError(f"{'--model-name' if '--model-name' in given else '--adapters'}: needs --model DIR")
    placed = (("device", args.device), ("dtype", args.dtype), ("kv_cache_mb", args.kv_cache_mb))
    placement = {k: v for k, v in placed if v is not None}
    raw: dict[str, Any] = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.model is None:
        smollm2 = {"path": "smollm2", "workers": DEFAULT_WORKERS if args.workers is None else args.workers}
        raw |= {"models": [smollm2 | placement, {"path": "tiny"} | placement], "auto": list(DEFAULT_AUTO)}
    else:
        model = {"path": args.model, "workers": 1 if args.workers is None else args.workers} | placement
        model |= {k: v for k, v in (("name", args.model_name), ("adapters", args.adapters)) if v is not None}
        raw["models"] = [model]
    try:
        return parse_stack(raw, "command line", Path.cwd())
    except StackError as err:  # "command line: models[0].workers: ..." -> "--workers: ..."
        found = re.match(r"command line: (?:models\[\d+\]\.)?(\w+)(?:\[\d+\])?: (.*)", str(err), re.S)
        if found is None or found.group(1) not in _FLAG_OF:
            raise
        raise StackError(f"{_FLAG_OF[found.group(1)]}: {found.group(2)}") from None
