"""guidellm (a standard load generator for OpenAI-compatible servers) against the fleet, beside our own
clients (`loadtest.fleet`, unless `--no-guidellm`): its numbers are an outside check on ours, measured by
a tool that knows nothing of loragate.

One `guidellm run` (a subprocess in its own process group, killed on timeout, offline: HF_HUB_OFFLINE etc.):
streamed `/v1/completions` with the fleet's bearer key, Poisson arrivals at `rate`, `max_requests`
synthetic (Faker) prompts of `prompt_tokens` tokens by the model's own tokenizer, each asking for exactly
`output_tokens` (guidellm sends `max_tokens` with `ignore_eos: true`; we add `temperature: 0`). Its JSON
report's first benchmark maps to our figures as follows:

- requests / errors: `request_totals` successful / the scheduler's `requests_made` errored + incomplete (a
  429 from admission is an error; a run with no success raises). `requests_made` also counts requests
  guidellm cancelled before they started, which `request_totals` leave out (though the last event of a
  run, if it is such a cancellation, reaches neither: a loaded run once reported 15 of 16);
- ttft_p50_ms / ttft_p99_ms: percentiles of `time_to_first_token_ms` over successful requests (request
  headers sent to first streamed text chunk);
- itl_p50_ms / itl_p99_ms: percentiles of `inter_token_latency_ms`, a per-request mean gap, (last token -
  first token) / (output tokens - 1), weighted by tokens: not the percentiles of single gaps;
- output_tok_s / request_rate: the means of `output_tokens_per_second` / `requests_per_second` (successful),
  time-weighted rates over the benchmark's window, i.e. about tokens (requests) / duration.

guidellm gets one scheduler worker process per 4 cores, 1 to 4 (its default is 10 spawned processes, each
importing torch, which on a small machine takes the CPU the server needs and draws 429s), and its data
loader prepares `max_requests` prompts ahead, not its default 4,096 (each one tokenized, while the server
runs: on a small machine that took 12 s before the first request and drew 429s). Pinned in the
`fleet` extra (guidellm==0.8.1): its option schema changes between minors.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_available() -> bool:
    return shutil.which("guidellm") is not None


def guidellm_command(
    url: str, api_key: str, model: str, tokenizer_dir: Path, rate: float, max_requests: int,
    prompt_tokens: int, output_tokens: int, report: Path,
) -> list[str]:  # fmt: skip
    """`guidellm run` with each option's config as a JSON object (guidellm parses them as YAML)."""
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "api_key": api_key,
        "request_format": "/v1/completions",
        "stream": True,
        "http2": False,
        "extras": {"body": {"temperature": 0}},
    }
    data = {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    options: list[tuple[str, dict[str, Any]]] = [
        ("--backend", backend),
        ("--profile", {"kind": "poisson", "rate": rate}),
        ("--data", data),
        ("--tokenizer", {"kind": "huggingface_auto", "model": str(tokenizer_dir)}),
        ("--constraint", {"kind": "max_requests", "count": max_requests}),
        # A run needs `max_requests` prompts, not the 4,096 its data loader makes ahead by default.
        ("--data-loader", {"kind": "pytorch", "prefetch_factor": max(max_requests, 16)}),
        ("--output", {"kind": "json", "path": str(report)}),
    ]
    cmd = [shutil.which("guidellm") or "guidellm", "run", "--disable-console-interactive"]
    for flag, config in options:
        cmd += [flag, json.dumps(config, separators=(",", ":"))]
    return cmd


def run_guidellm(
    url: str, api_key: str, model: str, tokenizer_dir: Path, rate: float, max_requests: int,
    prompt_tokens: int, output_tokens: int, out_dir: Path, timeout_s: float = 600,
) -> dict[str, float]:  # fmt: skip
    """guidellm's figures (module docstring); its command line (key masked), output, report in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report, log = out_dir / "guidellm.json", out_dir / "guidellm.log"
    report.unlink(missing_ok=True)
    cmd = guidellm_command(
        url, api_key, model, tokenizer_dir, rate, max_requests, prompt_tokens, output_tokens, report
    )
    shown = shlex.join(cmd).replace(api_key, "<api-key>") if api_key else shlex.join(cmd)
    (out_dir / "command.sh").write_text(shown + "\n")
    procs = max(1, min(4, (os.cpu_count() or 1) // 4))
    # Quiet: a pydantic deprecation warning of guidellm's own at import (fatal under PYTHONWARNINGS=error).
    env = {**os.environ, **OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": str(procs), "COLUMNS": "200"}
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    with log.open("wb") as out:
        # cwd: guidellm writes its default outputs and log file (if any) to the working directory.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=out_dir, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as err:  # the timeout, or our own interruption: take guidellm's workers too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                raise RuntimeError(f"guidellm ran past {timeout_s} s:\n{tail(log)}") from None
            raise
    if code != 0 or not report.exists():
        raise RuntimeError(f"guidellm failed (exit {code}):\n{tail(log)}")
    parsed = json.loads(report.read_text())
    result = figures(parsed)
    if not result["requests"]:  # its latencies would read 0: a failed run, not a fast one
        errored = parsed["benchmarks"][0]["requests"]["errored"]
        first = errored[0]["info"]["error"] if errored else "none errored"
        raise RuntimeError(f"guidellm: no request succeeded (first error: {first}):\n{tail(log)}")
    return result


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def figures(report: dict[str, Any]) -> dict[str, float]:
    """The first benchmark of a guidellm JSON report, in our terms."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    totals, made = metrics["request_totals"], benchmark["scheduler_metrics"]["requests_made"]

    def pct(name: str, q: str) -> float:
        return float(metrics[name]["successful"]["percentiles"][q])

    return {
        "requests": float(totals["successful"]),
        "errors": float(made["errored"] + made["incomplete"]),
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
        "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
        "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
        "output_tok_s": float(metrics["output_tokens_per_second"]["successful"]["mean"]),
        "request_rate": float(metrics["requests_per_second"]["successful"]["mean"]),
    }
