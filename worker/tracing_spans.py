"""A request's life on the worker as trace spans, continuing the gateway's trace from the message.

Steps serve many requests at once, so per-request timings are recorded as they happen and the spans are
written with those timestamps when the request ends: `queue wait` (enqueue → admission), then
`{operation} {model}` (GenAI span: admission → last token) with children `adapter load` (if the adapter
was not on the device), `prefill` (admission → first token; tokens computed vs from the prefix cache) and
`decode` (first → last token). TTFT and mean ITL are attributes of the GenAI span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer, set_span_in_context

from loragate import contracts
from loragate.messages import QueuedRequest
from loragate.tracing import extract


def _ns(t: float) -> int:
    return int(t * 1e9)


@dataclass
class RequestTimeline:
    message: QueuedRequest
    admitted: float = field(default_factory=time.time)
    adapter_load_s: float = 0.0
    adapter_tier: str = "none"
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    cached_tokens: int = 0

    def on_tokens(self, n: int, cached_tokens: int) -> None:
        now = time.time()
        if n and self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += n
        self.cached_tokens = cached_tokens


def emit_spans(tracer: Tracer, t: RequestTimeline, worker_id: str, finish_reason: str | None) -> None:
    msg = t.message
    parent = extract(msg.traceparent)
    end = t.last_token or time.time()
    queue = tracer.start_span(
        "queue wait",
        context=parent,
        start_time=_ns(min(msg.enqueued_at, t.admitted)),
        attributes={"loragate.worker": worker_id, "loragate.attempt": msg.attempt},
    )
    queue.end(end_time=_ns(t.admitted))
    operation = msg.operation
    ttft = (t.first_token - msg.enqueued_at) if t.first_token else None
    itl = ((end - t.first_token) / (t.tokens - 1)) if t.first_token and t.tokens > 1 else None
    attrs: dict[str, str | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "loragate",
        "gen_ai.request.model": msg.model,
        "gen_ai.request.max_tokens": msg.params.max_tokens,
        "gen_ai.response.id": contracts.client_request_id(msg.request_id),  # the id the client got
        "gen_ai.response.finish_reasons": finish_reason or "",
        "gen_ai.usage.input_tokens": len(msg.prompt_token_ids),
        "gen_ai.usage.output_tokens": t.tokens,
        "loragate.worker": worker_id,
        "loragate.adapter": msg.adapter or "",
        "loragate.adapter_tier": t.adapter_tier,
        "loragate.cached_tokens": t.cached_tokens,
    }
    if ttft is not None:
        attrs["loragate.ttft_s"] = ttft
    if itl is not None:
        attrs["loragate.itl_s"] = itl
    gen = tracer.start_span(
        f"{operation} {msg.model}", context=parent, start_time=_ns(t.admitted), attributes=attrs
    )
    inner = set_span_in_context(gen)
    cursor = t.admitted
    if t.adapter_load_s > 0:
        attributes = {"loragate.adapter": msg.adapter or "", "loragate.from_tier": t.adapter_tier}
        load = tracer.start_span("adapter load", context=inner, start_time=_ns(cursor), attributes=attributes)
        cursor += t.adapter_load_s
        load.end(end_time=_ns(cursor))
    first = t.first_token or end
    prefill = tracer.start_span(
        "prefill",
        context=inner,
        start_time=_ns(t.admitted),
        attributes={
            "loragate.prompt_tokens": len(msg.prompt_token_ids) + len(msg.resume_token_ids),
            "loragate.tokens_computed": len(msg.prompt_token_ids)
            + len(msg.resume_token_ids)
            - t.cached_tokens,
            "loragate.tokens_cached": t.cached_tokens,
        },
    )
    prefill.end(end_time=_ns(first))
    decode = tracer.start_span(
        "decode", context=inner, start_time=_ns(first), attributes={"loragate.tokens": t.tokens}
    )
    decode.end(end_time=_ns(end))
    gen.end(end_time=_ns(end))
