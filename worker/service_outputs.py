"""A step's outputs on their way to the clients: one event per request on its stream `lg:out:{id}`.

Each event is recorded in the ledger (`worker.ledger`) before it is written, so whatever a failing Redis
does not receive can be written again after the outage; the writes go into the service's per-step
write (`worker.service_writes`), whose acks follow them, so a request is acknowledged only after its last
event is stored. Once that write has gone through, the finished requests are retired and their trace
spans emitted (`worker.tracing_spans`). `already_streamed` reads a stream back: where a request
that was started before (on this worker or another) must continue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from opentelemetry.trace import Tracer

from loragate import contracts
from loragate.messages import OutputEvent, streamed_so_far
from loragate.types import RequestOutput
from worker.ledger import Held, Ledger
from worker.tracing_spans import emit_spans

if TYPE_CHECKING:
    from worker.service_writes import StepWrite


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

    def record(self, write: StepWrite, outputs: list[RequestOutput]) -> None:
        """Each held request's event, recorded in the ledger, then added to the step's `write`."""
        for out in outputs:
            if (event := self.ledger.record(out)) is not None:
                write.events.append((out.request_id, event))
                write.tokens += len(out.new_token_ids)
                if event.is_last:
                    write.finished.append(out.request_id)

    def delivered(self, finished: list[str]) -> None:
        """The last events and acks of `finished` are written: retire them, with their spans."""
        for rid in finished:
            self.spans(self.ledger.retire(rid))

    def spans(self, done: Held) -> None:
        if self.tracer is not None and done.timeline is not None:
            emit_spans(self.tracer, done.timeline, self.worker_id, done.events[-1].finish_reason)
