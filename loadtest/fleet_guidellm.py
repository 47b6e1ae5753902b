"""guidellm (a standard load generator for OpenAI-compatible servers) against the fleet, beside our own
clients (`loadtest.fleet --guidellm`): its numbers are an outside check on ours, measured by a tool that
knows nothing of loragate.

One `guidellm run` (a subprocess in its own process group, killed on timeout) from a scenario file:
streamed `/v1/completions` with the fleet's API key, Poisson arrivals at `rate`, `max_requests` synthetic
prompts of about `prompt_tokens` tokens (tokenized with the model's own tokenizer) asking for
`output_tokens`, its JSON report read back. Pinned in the `fleet` extra (guidellm==0.8.1): optional, as it
pulls a web framework and dataset tooling that nothing else needs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def guidellm_available() -> bool:
    return shutil.which("guidellm") is not None


def scenario(
    url: str, api_key: str, model: str, tokenizer_dir: Path, rate: float, max_requests: int,
    prompt_tokens: int, output_tokens: int, report: Path,
) -> dict[str, Any]:  # fmt: skip
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "api_key": api_key,
                "request_format": "/v1/completions",
                "http2": False,
                "stream": True,
            },
            "profile": {"kind": "poisson", "rate": [rate]},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": prompt_tokens,
                    "output_tokens": output_tokens,
                }
            ],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "constraints": [{"kind": "max_requests", "count": max_requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def run_guidellm(
    url: str, api_key: str, model: str, tokenizer_dir: Path, rate: float, max_requests: int,
    prompt_tokens: int, output_tokens: int, out_dir: Path, timeout_s: float = 600,
) -> dict[str, float]:  # fmt: skip
    """guidellm's figures: successful and failed requests, TTFT and ITL p50/p99 (ms), output tokens/s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "guidellm.json"
    spec = scenario(
        url, api_key, model, tokenizer_dir, rate, max_requests, prompt_tokens, output_tokens, report
    )
    path = out_dir / "scenario.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "guidellm", "run", "--scenario", str(path), "--disable-console-interactive"]
    log = out_dir / "guidellm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"guidellm ran past {timeout_s} s:\n{log.read_text()[-3000:]}") from None
    if code != 0 or not report.exists():
        raise RuntimeError(f"guidellm failed ({code}):\n{log.read_text()[-3000:]}")
    return figures(json.loads(report.read_text()))


def figures(report: dict[str, Any]) -> dict[str, float]:
    """The first benchmark of a guidellm JSON report, in our terms."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]

    def pct(name: str, q: str) -> float:
        return float(metrics[name]["successful"]["percentiles"][q])

    return {
        "requests": float(totals["successful"]),
        "errors": float(totals["errored"]),
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
        "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
        "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
        "output_tok_s": float(metrics["output_tokens_per_second"]["successful"]["mean"]),
        "request_rate": float(metrics["requests_per_second"]["successful"]["mean"]),
    }
