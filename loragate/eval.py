"""`loragate eval`: the shipped adapters' accuracy against their base model, through a running fleet.

For each task of `loragate.adapter_tasks`, its held-out prompts go through `/v1/chat/completions`
(temperature 0) once to the base model (`smollm2`) and once to its adapter (`smollm2:<task>`), and the
task's checker scores each answer. The fleet is the one named by `--base-url`/`--api-key`, else by
`OPENAI_BASE_URL`/`OPENAI_API_KEY`, else the newest live `loragate up` on this machine. Prints a table,
then one JSON object as the last line of stdout (per task: n, base and adapter accuracy, gain; and the
mean gain). Standard library only: no torch, no HTTP client dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from tqdm import tqdm

from loragate.adapter_tasks import AdapterTask, Example, select
from loragate.endpoint import Endpoint, live_endpoints
from loragate.paths import cache_dir

MAX_TOKENS = 64
# A busy fleet answers 429 (or 503 while its workers start); like OpenAI's clients, eval waits and retries.
RETRY_STATUS = (429, 503)
MAX_TRIES = 12


class EvalError(Exception):
    """A failure the user can act on (no endpoint, refused request); its message says what to do."""


@dataclass(frozen=True)
class TaskScore:
    task: str
    n: int
    base_correct: int
    adapter_correct: int

    @property
    def base_accuracy(self) -> float:
        return self.base_correct / self.n

    @property
    def adapter_accuracy(self) -> float:
        return self.adapter_correct / self.n

    @property
    def gain(self) -> float:
        return self.adapter_accuracy - self.base_accuracy


def find_endpoint(base_url: str | None, api_key: str | None) -> Endpoint:
    """The flags, else the environment, else the newest live `loragate up`."""
    url = base_url or os.environ.get("OPENAI_BASE_URL")
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if url:
        if not key:
            raise EvalError(f"no API key for {url}: pass --api-key or set OPENAI_API_KEY")
        return Endpoint(url.rstrip("/"), key)
    up_root = cache_dir() / "up"
    live = live_endpoints(up_root)
    if not live:
        raise EvalError(
            f"no fleet to evaluate: no --base-url, no OPENAI_BASE_URL, and no live `loragate up` under "
            f"{up_root}. Start one with `loragate up` (it serves smollm2 and its adapters), or pass "
            "--base-url URL --api-key KEY."
        )
    return live[0]


def chat(endpoint: Endpoint, model: str, prompt: str, timeout: float = 300.0) -> str:
    """The assistant's text for one user message, greedy."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    request = urllib.request.Request(
        f"{endpoint.base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"},
    )
    for attempt in range(MAX_TRIES):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                reply = json.loads(resp.read())
            return str(reply["choices"][0]["message"]["content"] or "")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code not in RETRY_STATUS or attempt == MAX_TRIES - 1:
                raise EvalError(f"{endpoint.base_url}: model {model!r}: HTTP {e.code}: {detail}") from e
            time.sleep(_retry_after(e.headers.get("Retry-After"), attempt))
        except (urllib.error.URLError, OSError) as e:
            raise EvalError(f"{endpoint.base_url}: cannot reach the fleet ({e})") from e
    raise AssertionError("unreachable")


def _retry_after(header: str | None, attempt: int) -> float:
    try:
        return min(30.0, float(header)) if header else min(30.0, 2.0**attempt)
    except ValueError:
        return min(30.0, 2.0**attempt)


def score_task(
    endpoint: Endpoint,
    model: str,
    task: AdapterTask,
    n: int,
    pool: ThreadPoolExecutor,
    progress: tqdm | None = None,
) -> TaskScore:
    examples = task.examples("heldout", n)

    def correct(target: str) -> int:
        def one(ex: Example) -> bool:
            ok = task.check(chat(endpoint, target, ex.prompt), ex.expected)
            if progress is not None:
                progress.update(1)
            return ok

        return sum(pool.map(one, examples))

    return TaskScore(task.name, n, correct(model), correct(f"{model}:{task.name}"))


def table(scores: Sequence[TaskScore]) -> str:
    lines = [f"{'task':<10} {'n':>4} {'base':>7} {'adapter':>8} {'gain':>7}"]
    for s in scores:
        lines.append(
            f"{s.task:<10} {s.n:>4} {s.base_accuracy:>7.0%} {s.adapter_accuracy:>8.0%} "
            f"{100 * s.gain:>+6.0f}pt"
        )
    return "\n".join(lines)


def summary(model: str, scores: Sequence[TaskScore]) -> dict[str, object]:
    return {
        "model": model,
        "tasks": {
            s.task: {
                **{k: v for k, v in asdict(s).items() if k != "task"},
                "base_accuracy": s.base_accuracy,
                "adapter_accuracy": s.adapter_accuracy,
                "gain": s.gain,
            }
            for s in scores
        },
        "mean_gain": sum(s.gain for s in scores) / len(scores),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="loragate eval",
        description="Accuracy of each adapter vs its base model on the tasks' held-out prompts.",
    )
    parser.add_argument("--base-url", help="OpenAI base URL, ending in /v1 (default: $OPENAI_BASE_URL)")
    parser.add_argument("--api-key", help="API key (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", default="smollm2", help="base model name (default: smollm2)")
    parser.add_argument("--tasks", help="comma-separated task names (default: all)")
    parser.add_argument("--n", type=int, default=50, help="held-out prompts per task (default: 50)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    if args.concurrency < 1:
        parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    try:
        tasks = select(args.tasks)
    except ValueError as e:
        parser.error(str(e))
    try:
        endpoint = find_endpoint(args.base_url, args.api_key)
        total = 2 * args.n * len(tasks)  # each prompt to the base model and to the adapter
        with (
            ThreadPoolExecutor(args.concurrency) as pool,
            tqdm(total=total, desc="eval", unit="req", file=sys.stderr, disable=args.quiet) as bar,
        ):
            scores = [score_task(endpoint, args.model, t, args.n, pool, bar) for t in tasks]
    except EvalError as e:
        print(f"loragate eval: {e}", file=sys.stderr)
        return 1
    print(table(scores))
    print(json.dumps(summary(args.model, scores)))
    return 0
