"""lm-eval (`lm_eval==0.4.13`) against a running loragate fleet, through its `local-completions` client.

Two small tasks with the data shipped in `loadtest/lm_eval_tasks/` (no download: this machine reaches only
package registries): `lg_mc`, 40 four-way multiple-choice questions (capitals, opposites, sums), scored by
log-likelihood — lm-eval sends each batch of `--batch-size` prompts as one `/v1/completions` request with
token-id prompts, `echo: true`, `logprobs: 1`, `max_tokens: 1`, and reads the prompt tokens' logprobs —
and `lg_gen`, 20 capital-city questions answered by greedy generation (`generate_until`, batched the same
way, stopping at a newline or period, after two worked examples), scored by exact match. The last line
printed is one JSON object: per task its accuracy, and the wall time.

    python -m loadtest.lm_eval_run [--base-url URL --api-key KEY] [--model smollm2] [--tokenizer DIR]
        [--batch-size 4] [--limit N]

Without `--base-url` it finds the newest live `loragate up` (as `loragate eval` does). `--tokenizer` is the
model's checkpoint directory (lm-eval tokenizes the prompts itself); by default the checkpoint `up` serves
under `--model`'s name.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")

MC_TASK = """task: lg_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: lg_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{shots}Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""


# Two worked examples (countries not in the data) before each generation question: zero-shot, a small
# instruct model answers with a newline first, which ends the generation at once.
SHOTS = (
    "Question: What is the capital of Belgium?\\nAnswer: Brussels\\n\\n"
    "Question: What is the capital of Chile?\\nAnswer: Santiago\\n\\n"
)


def write_tasks(directory: Path) -> None:
    """The two task configs, pointing at the shipped data by absolute path."""
    (directory / "lg_mc.yaml").write_text(MC_TASK.format(data=TASKS_DIR / "mc.jsonl"))
    (directory / "lg_gen.yaml").write_text(GEN_TASK.format(data=TASKS_DIR / "gen.jsonl", shots=SHOTS))


def run(
    base_url: str, api_key: str, model: str, tokenizer: Path, batch_size: int, limit: int | None
) -> dict[str, Any]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OPENAI_API_KEY"] = api_key  # local-completions sends it as the bearer token
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        write_tasks(Path(tmp))
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": model,
                "base_url": f"{base_url.rstrip('/')}/completions",
                "tokenizer": str(tokenizer),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 2,
                "max_length": 2048,
            },
            tasks=["lg_mc", "lg_gen"],
            batch_size=batch_size,
            limit=limit,
            # Only these two tasks: indexing lm-eval's own ~14,000 task configs takes longer than the run.
            task_manager=TaskManager(include_path=tmp, include_defaults=False),
            log_samples=False,
        )
    assert results is not None
    scores = results["results"]
    return {
        "model": model,
        "batch_size": batch_size,
        "limit": limit,
        "mc_acc": round(float(scores["lg_mc"]["acc,none"]), 4),
        "mc_n": int(results["n-samples"]["lg_mc"]["effective"]),
        "gen_exact_match": round(float(scores["lg_gen"]["exact_match,none"]), 4),
        "gen_n": int(results["n-samples"]["lg_gen"]["effective"]),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loragate.eval import find_endpoint
    from loragate.stack_sources import checkpoint_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="the fleet's OpenAI base URL, ending in /v1")
    parser.add_argument("--api-key")
    parser.add_argument("--model", default="smollm2", help="the model name to evaluate (default: smollm2)")
    parser.add_argument("--tokenizer", type=Path, help="its checkpoint directory (default: up's for --model)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--limit", type=int, help="at most this many documents per task")
    args = parser.parse_args(argv)
    endpoint = find_endpoint(args.base_url, args.api_key)
    tokenizer = args.tokenizer or checkpoint_dir(args.model.split(":")[0])
    out = run(endpoint.base_url, endpoint.api_key, args.model, tokenizer, args.batch_size, args.limit)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
