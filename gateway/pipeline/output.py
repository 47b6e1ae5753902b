"""The request's output as one handler reads it: its event channel, the reservation it holds on its
worker (when this handler queued it), and the ways it ends. An abort read while this handler's client
is still there (a retry; another handler of the same id whose client left) continues the request on the
least-loaded worker after the tokens already streamed, so a retry never gets a cut-short answer as a
success. `finish` and `cancel` release the reservation; both may run more than once."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from redis.exceptions import RedisError

from gateway.context import GatewayContext
from gateway.errors import APIError, queue_unavailable
from gateway.event_channel import ClientGone, EventChannel
from gateway.pipeline.job import Job
from gateway.pipeline.resolve import no_worker
from gateway.reaper import least_loaded
from loragate.messages import OutputEvent
from policies.routing_state import Phase, Reservation

log = logging.getLogger("loragate.gateway")
LIVENESS_S = 5.0  # how often a wait for output checks that a worker still serves the model
MAX_CONTINUES = 8  # a request cut short by cancels more often than this fails instead


class OutputReader:
    def __init__(
        self, ctx: GatewayContext, job: Job, base: str, events: EventChannel, reservation: Reservation | None
    ):
        self.ctx, self.job, self.base, self.events = ctx, job, base, events
        self.reservation = reservation  # None: another handler (or none, until a continue) accounts for it
        self.continued = 0  # how often this handler queued the request again after an abort

    async def next(self, timeout: float) -> OutputEvent:
        """The next event; fails instead of hanging when no worker can produce it, and raises
        `ClientGone` when the client disconnected. An abort is never handed out: this handler's client
        is still there, so the request is continued."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, "Timed out waiting for the model's output.", code="timeout")
            try:
                event = await self.events.get(min(LIVENESS_S, remaining))
            except TimeoutError:
                if not self.ctx.fleet.serving(self.base) and not self.ctx.settings.model_queue_max:
                    # (With the model's shared stream on, it waits there, or is put there by a reaper,
                    # for a worker to start, until `timeout`.)
                    raise no_worker(self.base, "any more") from None
                continue
            if event.finish_reason != "abort":
                return event
            if self.events.gone:  # nobody left to continue it for
                raise ClientGone()
            await self._continue()

    async def _continue(self) -> None:
        """Queue the request again on the least-loaded worker, which resumes after the tokens already
        streamed, and read on after the abort event (which the queueing deletes). Of several handlers
        that read the same abort, the first queues it; the others read on."""
        if self.continued >= MAX_CONTINUES:
            raise APIError(
                503,
                "The request was cancelled by its clients too often; please retry.",
                code="request_cancelled",
                headers={"Retry-After": "1"},
            )
        worker = least_loaded(self.ctx.fleet, self.base)
        if worker is None:
            raise no_worker(self.base, "any more")
        self.continued += 1
        now = time.time()
        msg = replace(
            self.job.message,
            attempt=self.continued,
            deadline=now + self.ctx.settings.request_timeout_s,
            enqueued_at=now,
        )
        worker_id = worker.state.worker_id
        try:
            async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
                entry = await self.job.store.revive(self.events.last_id, msg, self.job.fingerprint, worker_id)
                if entry is not None:
                    self._moved(worker_id)
                    log.info("continuing %s on %s after an abort", msg.request_id, worker_id)
                await self.ctx.mux.resume(self.base, msg.request_id, self.events)
        except (RedisError, TimeoutError) as e:
            log.warning("could not continue %s: %r", msg.request_id, e)
            raise queue_unavailable() from e

    def _moved(self, worker_id: str) -> None:
        """This handler queued the request on `worker_id`: it now counts there (and no longer before)."""
        if self.reservation is None or self.reservation.phase is Phase.RELEASED:
            reservation = self.reservation = self.ctx.router.state.reserve(worker_id, 0)
            reservation.commit()
        else:
            self.reservation.move(worker_id)

    def first_token(self) -> None:
        if self.reservation is not None:
            self.reservation.first_token()

    def finish(self) -> None:
        """Stop relaying the request; it no longer counts on its worker's load here."""
        self.ctx.mux.unsubscribe(self.base, self.job.qid, self.events)
        if self.reservation is not None:
            self.reservation.release()

    async def cancel(self) -> None:
        """Stop relaying, and cancel the request: dropped from its queue when no worker has read it yet,
        else aborted on its worker (best effort: when Redis cannot take the message, the worker finishes
        the request and its output expires unread)."""
        self.finish()
        qid = self.job.qid
        try:
            async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
                if await self.job.store.cancel(qid):
                    log.info("dropped %s from its queue before it ran", qid)
        except (RedisError, TimeoutError) as e:
            log.warning("could not cancel %s: %r", qid, e)
