"""A step's outputs on their way to the clients: one event per request on its stream `lg:out:{id}`.

Each event is recorded in the ledger (`worker.ledger`) before it is written, so whatever a failing Redis
does not receive can be written again after the outage; the writes go into the service's per-step
pipeline, whose acks (`worker.service_intake`) follow them, so a request is acknowledged only after its
last event is stored. Once that pipeline has gone through, the finished requests are retired and their
trace spans emitted (`worker.tracing_spans`). `already_streamed` reads a stream back: where a request
that was started before (on this worker or another) must continue.
"""

from __future__ import annotations

import redis
from opentelemetry.trace import Tracer
from redis.client import Pipeline

from loragate import contracts
from loragate.messages import OutputEvent, streamed_so_far
from loragate.types import RequestOutput
from worker.ledger import Held, Ledger
from worker.tracing_spans import emit_spans


def add_event(r: redis.Redis, model: str, request_id: str, event: OutputEvent) -> None:
    """Append `event` to the request's output stream and renew the stream's TTL (`r` may be a pipeline)."""
    key = contracts.output(model, request_id)
    r.xadd(key, {contracts.OUTPUT_FIELD: event.to_json()})
    r.expire(key, contracts.OUTPUT_TTL_S)


def already_streamed(r: redis.Redis, model: str, request_id: str) -> tuple[list[int], str, bool]:
    """Tokens and text a request's output stream already holds, and whether its last event was written."""
    return streamed_so_far(r.xrange(contracts.output(model, request_id)))


class OutputWriter:
    def __init__(self, ledger: Ledger, worker_id: str, tracer: Tracer | None):
        self.ledger, self.worker_id, self.tracer = ledger, worker_id, tracer

    def add(self, pipe: Pipeline, outputs: list[RequestOutput]) -> list[str]:
        """Each held request's event, recorded then added to `pipe`; returns the requests that finished."""
        finished = []
        for out in outputs:
            if (event := self.ledger.record(out)) is not None:
                add_event(pipe, self.ledger.model, out.request_id, event)
                if event.is_last:
                    finished.append(out.request_id)
        return finished

    def delivered(self, finished: list[str]) -> None:
        """The last events and acks of `finished` are written: retire them, with their spans."""
        for rid in finished:
            self.spans(self.ledger.retire(rid))

    def spans(self, done: Held) -> None:
        if self.tracer is not None and done.timeline is not None:
            emit_spans(self.tracer, done.timeline, self.worker_id, done.events[-1].finish_reason)
