"""The correctness reference: Hugging Face `transformers` + `peft` greedy decoding, one request at a time.

Used by the engine's parity tests and by `bench_engine`'s `tokens_match`. The base model is loaded once,
every adapter is attached to one `PeftModel` and selected per request (`disable_adapter()` for base
requests), and decoding is a plain KV-cached argmax loop, with no EOS handling, in float32 on the CPU
unless told otherwise (`bench_engine` runs it on the engine's device and dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel


class HFReference:
    def __init__(
        self,
        model_dir: Path,
        adapters: Mapping[str, Path],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        base.to(device)
        base.eval()
        self.device = device
        self.model: PreTrainedModel | PeftModel = base
        names = list(adapters)
        if names:
            peft_model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                peft_model.load_adapter(str(adapters[name]), adapter_name=name)
            peft_model.eval()
            self.model = peft_model

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int, adapter: str | None = None) -> list[int]:
        if adapter is None and isinstance(self.model, PeftModel):
            with self.model.disable_adapter():
                return self._loop(prompt, max_tokens)
        if isinstance(self.model, PeftModel):
            self.model.set_adapter(adapter)
        return self._loop(prompt, max_tokens)

    def _loop(self, prompt: list[int], max_tokens: int) -> list[int]:
        out: list[int] = []
        ids = torch.tensor([prompt], device=self.device)
        past = None
        for _ in range(max_tokens):
            res = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]], device=self.device)
        return out
