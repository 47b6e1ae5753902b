"""One timed vLLM run of a `loadtest.bench_vllm` job, in vLLM's own interpreter (stdlib and vllm only:
vLLM pins its own transformers, so it lives in an environment of its own, not loragate's).

    <vllm's python> loadtest/vllm_side.py JOB.json OUT.json

The job names the checkpoint, the dtype, the adapters (when `lora`), the requests (prompt token ids,
output length, adapter or null) and a warm-up list. The engine is vLLM's offline `LLM` with its own
defaults for this machine (`engine_args` may add to them); LoRA is enabled only for a `lora` job, with
room for every adapter on the device at once, so the base run is vLLM at its best without LoRA. The
warm-up runs off the clock (it also loads every adapter), then all requests go to one `generate` call,
greedy with EOS ignored; OUT gets the wall time, tokens per second and every request's output tokens.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters: dict[str, str] = job["adapters"] if job["lora"] else {}
    lora_args: dict[str, Any] = (
        {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": job["max_lora_rank"]}
        if adapters
        else {}
    )
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], seed=0, **lora_args, **job.get("engine_args", {}))
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    loras = {name: LoRARequest(name, ids[name], path) for name, path in adapters.items()}

    def generate(requests: list[dict[str, Any]]) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests
        ]
        chosen = [loras[r["adapter"]] if r["adapter"] else None for r in requests]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=chosen if adapters else None, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    generate(job["warmup"])
    seconds, tokens = generate(job["requests"])
    output_tokens = sum(len(t) for t in tokens)
    settings: dict[str, Any] = {}
    try:
        config = llm.llm_engine.vllm_config
        settings = {
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "enforce_eager": config.model_config.enforce_eager,
            "compilation_mode": str(config.compilation_config.mode),
        }
    except AttributeError:  # another vLLM's layout: the figures stand without it
        pass
    import vllm

    return {
        "seconds": seconds,
        "output_tokens": output_tokens,
        "tok_s": output_tokens / seconds,
        "tokens": tokens,
        "version": vllm.__version__,
        "settings": settings,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's engine starts processes of its own: its entry point must be guarded
    sys.exit(main(sys.argv[1:]))
