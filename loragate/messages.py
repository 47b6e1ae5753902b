"""Messages that cross Redis between gateway and worker: queued requests, output events, worker state.

All are frozen dataclasses with explicit JSON encodings, so either side can be restarted or replaced
without sharing Python objects. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, cast

from loragate import contracts
from loragate.types import SamplingParams, TokenLogprob


@cache
def _field_names(cls: Hashable) -> tuple[str, ...]:  # a dataclass type
    return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


def shallow_dict(obj: Any) -> dict[str, Any]:
    """A flat dataclass's fields as a dict, without `dataclasses.asdict`'s recursive deep copy (which
    costs tens of microseconds per message on the request path). Values are used as they are."""
    return {name: getattr(obj, name) for name in _field_names(cast(Hashable, type(obj)))}


def _dumps(d: dict[str, Any]) -> str:
    return json.dumps(d, separators=(",", ":"))


def _params_from(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    d["stop"] = tuple(d.get("stop", ()))
    d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
    d["logit_bias"] = tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))
    return SamplingParams(**d)


def logprobs_to_json(items: tuple[TokenLogprob, ...]) -> list[Any]:
    """Compact: `[token_id, logprob, [[id, logprob], ...]]` per token."""
    return [[t.token_id, t.logprob, [list(p) for p in t.top]] for t in items]


def logprobs_from_json(raw: list[Any]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(int(i), float(lp), tuple((int(a), float(b)) for a, b in top)) for i, lp, top in raw
    )


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One request on a worker's queue stream.

    `resume_token_ids` are tokens a previous worker already generated and streamed (it died): the next
    worker continues after them, so the client's answer goes on unbroken.
    """

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    adapter: str | None = None  # registry key "{base}:{name}"
    tenant: str = ""
    traceparent: str | None = None
    deadline: float = 0.0  # unix time; 0 = none
    attempt: int = 0
    resume_token_ids: tuple[int, ...] = ()
    enqueued_at: float = field(default_factory=time.time)
    operation: str = "text_completion"  # or "chat" (GenAI operation name, for traces)

    def to_json(self) -> str:
        d = shallow_dict(self)
        d["params"] = shallow_dict(self.params)
        return _dumps(d)

    @staticmethod
    def from_json(raw: str | bytes) -> QueuedRequest:
        d = json.loads(raw)
        d["prompt_token_ids"] = tuple(d["prompt_token_ids"])
        d["resume_token_ids"] = tuple(d.get("resume_token_ids", ()))
        d["params"] = _params_from(d["params"])
        return QueuedRequest(**d)


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """One step's output for one request, appended to `lg:out:{request_id}`.

    `error` is an OpenAI-style error object (`message`, `type`, `code`) with an HTTP `status`.
    """

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""
    error: dict[str, Any] | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of `token_ids`, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with the first event, when asked for (echo)

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def to_json(self) -> str:
        d = shallow_dict(self)
        for name in ("logprobs", "prompt_logprobs"):
            if d[name]:
                d[name] = logprobs_to_json(d[name])
            else:
                del d[name]  # most requests ask for none: keep their events small
        return _dumps(d)

    @staticmethod
    def from_json(raw: str | bytes) -> OutputEvent:
        d = json.loads(raw)
        d["token_ids"] = tuple(d.get("token_ids", ()))
        for name in ("logprobs", "prompt_logprobs"):
            d[name] = logprobs_from_json(d.get(name, []))
        return OutputEvent(**d)


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker's heartbeat: what it serves and how loaded it is."""

    worker_id: str
    model: str
    model_dir: str
    max_model_len: int
    adapters_device: tuple[str, ...] = ()
    adapters_host: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16
    running: int = 0
    waiting: int = 0
    max_adapters: int = 0
    max_running: int = 0  # its engine's batch capacity (max_num_seqs); 0 from workers that do not say
    draining: bool = False
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    device: str = ""  # where its engine runs (cpu, cuda, cuda:N); empty from workers that do not say
    dtype: str = ""  # its engine's precision (float32, bfloat16, float16)
    updated_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return _dumps(shallow_dict(self))

    @staticmethod
    def from_json(raw: str | bytes) -> WorkerState:
        d = json.loads(raw)
        for k in ("adapters_device", "adapters_host", "pinned"):
            d[k] = tuple(d.get(k, ()))
        return WorkerState(**d)


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """An adapter in the registry (`lg:adapters`): which base it belongs to, where its files are,
    which tenants may use it (empty = every tenant), and whether workers keep it resident."""

    name: str
    base: str
    path: str
    tenants: tuple[str, ...] = ()
    pinned: bool = False

    @property
    def key(self) -> str:
        return f"{self.base}:{self.name}"

    def allows(self, tenant: str) -> bool:
        return not self.tenants or tenant in self.tenants

    def to_json(self) -> str:
        return _dumps(shallow_dict(self))

    @staticmethod
    def from_json(raw: str | bytes) -> AdapterRecord:
        d = json.loads(raw)
        d["tenants"] = tuple(d.get("tenants", ()))
        return AdapterRecord(**d)


def streamed_so_far(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[list[int], str, bool]:
    """From a request's output-stream entries: the token ids and text already streamed, and whether it
    ended."""
    ids: list[int] = []
    texts: list[str] = []
    done = False
    for _, fields in entries:
        event = OutputEvent.from_json(fields[contracts.OUTPUT_FIELD_BYTES])
        ids.extend(event.token_ids)
        texts.append(event.text)
        done = done or event.is_last
    return ids, "".join(texts), done
