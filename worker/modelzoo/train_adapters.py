"""Train the shipped SmolLM2 LoRA adapters, one per task of `loragate.adapter_tasks`, on the CPU.

Each adapter is a PEFT LoRA trained for a fixed number of AdamW steps on that task's training prompts,
formatted with the base model's chat template exactly as the gateway formats a chat request (so the
served adapter sees what it was trained on); the loss covers only the answer tokens and the closing
`<|im_end|>`. Seeds are fixed, so a rerun on the same machine gives the same adapters. The specs mix
ranks, target modules and scalings (rsLoRA included) so that the shipped set exercises the engine's
multi-LoRA paths as well as showing visible behaviour. Saved in PEFT format with float16 weights and no
model card; `loragate models train-adapters` is the command line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from loragate.adapter_tasks import AdapterTask, select

SHIPPED_DIR = Path(__file__).parent / "smollm2_adapters"
BASE_NAME = "smollm2"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


@dataclass(frozen=True)
class TrainSpec:
    """How one task's adapter is trained."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    use_rslora: bool = False
    lr: float = 3e-3
    steps: int = 30
    batch: int = 6
    seed: int = 0


SPECS: dict[str, TrainSpec] = {
    "upper": TrainSpec(16, 32, ALL_LINEAR, seed=1),
    "reverse": TrainSpec(16, 16, ALL_LINEAR, use_rslora=True, lr=2e-3, seed=2),
    "digits": TrainSpec(8, 16, ("q_proj", "v_proj"), seed=3),
    "isodate": TrainSpec(8, 16, ATTENTION, seed=5),
    "brackets": TrainSpec(4, 8, ("q_proj", "v_proj"), seed=6),
    "signoff": TrainSpec(4, 4, ("q_proj", "v_proj"), use_rslora=True, seed=7),
}


@dataclass(frozen=True)
class TrainResult:
    task: str
    seconds: float
    final_loss: float
    bytes: int
    path: Path


def default_base() -> Path:
    from worker.hub.pull import ensure_model  # lands on another branch; imported only when needed

    return ensure_model(BASE_NAME)


def encode(tok: PreTrainedTokenizerBase, prompt: str, answer: str) -> tuple[list[int], int]:
    """The chat-formatted token ids of `prompt` + `answer` + end of turn, and where the answer starts."""
    head = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    head_ids = list(head["input_ids"] if hasattr(head, "keys") else head)
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return [*head_ids, *answer_ids, eos], len(head_ids)


def _batch(rows: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and a mask of the positions whose next token is an answer token."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    predicts = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, start) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        predicts[i, start - 1 : len(row) - 1] = True
    return ids, attn, predicts


def _loss(model: PeftModel, ids: torch.Tensor, attn: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
    # The LM head only at the answer positions: it is a fifth of the model's work per position.
    # bfloat16 autocast: about 1.5x faster on a CPU with AVX512-BF16; the LoRA weights stay float32.
    causal_lm = model.get_base_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = causal_lm.model(input_ids=ids, attention_mask=attn).last_hidden_state
        logits = causal_lm.lm_head(hidden[predicts])
    targets = ids[:, 1:][predicts[:, :-1]]
    return torch.nn.functional.cross_entropy(logits.float(), targets)


def train_one(
    base: Path, task: AdapterTask, spec: TrainSpec, out: Path, steps: int | None, progress: bool
) -> TrainResult:
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    start = time.monotonic()
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)
        peft_model = get_peft_model(model, config)
    n_steps = steps or spec.steps
    data = [encode(tok, ex.prompt, ex.expected) for ex in task.examples("train", n_steps * spec.batch)]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    warmup = max(1, n_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.05, (n_steps - s) / (n_steps - warmup + 1)))
    )
    peft_model.train()
    bar = tqdm(range(n_steps), desc=f"train {task.name}", disable=not progress, leave=False)
    loss_value = float("nan")
    for step in bar:
        rows = data[step * spec.batch : (step + 1) * spec.batch]
        rng.shuffle(rows)
        loss = _loss(peft_model, *_batch(rows, tok.pad_token_id or 0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}")
    save(peft_model, out)
    size = sum(p.stat().st_size for p in out.iterdir())
    return TrainResult(task.name, time.monotonic() - start, loss_value, size, out)


def save(model: PeftModel, out: Path) -> None:
    """PEFT format, float16 weights, the fleet's base name, sorted targets, no model card."""
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].base_model_name_or_path = BASE_NAME
    model.save_pretrained(str(out), save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)
    weights = out / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])  # PEFT saves a set in hash order
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def train_all(
    base: Path | None,
    out: Path | None,
    names: str | None = None,
    steps: int | None = None,
    progress: bool = True,
) -> list[TrainResult]:
    torch.set_num_threads(2)
    base = base or default_base()
    out = out or SHIPPED_DIR
    results = []
    for task in select(names):
        if task.name not in SPECS:
            raise ValueError(f"task {task.name!r} has no TrainSpec in worker.modelzoo.train_adapters.SPECS")
        results.append(train_one(base, task, SPECS[task.name], out / task.name, steps, progress))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="loragate models train-adapters",
        description="Train the SmolLM2 LoRA adapters of loragate.adapter_tasks on the CPU.",
    )
    parser.add_argument("--tasks", help="comma-separated task names (default: all)")
    parser.add_argument("--out", help=f"output directory (default: {SHIPPED_DIR})")
    parser.add_argument("--base", help="base model directory (default: `loragate models pull smollm2`'s)")
    parser.add_argument("--steps", type=int, help="optimizer steps per adapter (default: per task)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    try:
        results = train_all(
            Path(args.base) if args.base else None,
            Path(args.out) if args.out else None,
            args.tasks,
            args.steps,
            progress=not args.quiet,
        )
    except ValueError as e:
        parser.error(str(e))
    for r in results:
        size = f"{r.bytes / 1e6:.2f} MB"
        print(f"{r.task}: {r.seconds:.0f} s, final loss {r.final_loss:.3f}, {size} -> {r.path}")
    return 0
