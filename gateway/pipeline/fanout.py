"""The choices of one request, run side by side (`gateway.pipeline.choices` plans them): one task per
choice starts its job through the usual stages — attach when it is live already (a retry re-attaches
to every choice), else admit, route and enqueue — and relays its output events, in order, to the one
queue the answer reads (`next`).

Prefix sharing: each prompt's first choice (its lead) starts at once; its siblings when the lead's first
output event arrives. Its prompt is then prefilled and in that worker's prefix cache, and the routing
state records the prefix as sent there, so the prefix-aware policy sends the siblings to the same worker,
where they prefill only what the cache lacks. Different prompts start together.

Status and ending: the first event of every lead decides the status, as for one choice (`opened`). A
choice finishes its own job on its last event (metrics, its decision's outcome, the tenant's charge
settled, its reservation released); one that fails cancels its job and hands the answer its error; the
answer then `close`s the others (each job not ended is cancelled). A client that goes away
(`client_gone`) ends every choice. Nothing here runs for a request of one choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request

from gateway.choice_render import ChoiceRenderer
from gateway.context import GatewayContext
from gateway.errors import APIError, queue_unavailable
from gateway.event_channel import ClientGone
from gateway.pipeline.admit import admit, client_closed
from gateway.pipeline.choices import ChoicePlan, choices_usage
from gateway.pipeline.enqueue import attach, enqueue
from gateway.pipeline.finish import Finish, nothing_to_finish
from gateway.pipeline.output import OutputReader
from gateway.pipeline.parse import Call
from gateway.pipeline.resolve import Resolved
from gateway.pipeline.route import route, route_input
from loragate.messages import OutputEvent

log = logging.getLogger("loragate.gateway")
Item = OutputEvent | APIError | ClientGone  # what a choice hands the answer
_CLEANUPS: set[asyncio.Task[None]] = set()  # cancels of jobs whose start outlived their choice


def worker_error(err: dict[str, Any], default_status: int) -> APIError:
    """An error event's error as the answer's (a 503 says when to retry)."""
    status = int(err.get("status", default_status))
    again = {"Retry-After": "2"} if status == 503 else None
    return APIError(status, str(err.get("message")), code=err.get("code"), headers=again)


class Choice:
    """One choice's run: its plan, its job's reader once started, how it ends."""

    def __init__(self, plan: ChoicePlan, lead: Choice | None):
        self.plan, self.lead = plan, lead  # lead: None for a lead itself
        self.reader: OutputReader | None = None
        self.finish = nothing_to_finish  # this handler accounts for the job only when it queued it
        self.decision_id: str | None = None
        self.first: asyncio.Future[OutputEvent | APIError] = asyncio.get_running_loop().create_future()
        self.ended = False  # its job finished or was cancelled
        self.task: asyncio.Task[None] | None = None


class ChoiceSet:
    def __init__(
        self,
        ctx: GatewayContext,
        request: Request,
        call: Call,
        resolved: Resolved,
        plans: list[ChoicePlan],
        started: float,
    ):
        self.ctx, self.request, self.call, self.resolved = ctx, request, call, resolved
        self.plans, self.started = plans, started
        self.choices: list[Choice] = []
        for plan in plans:
            self.choices.append(Choice(plan, None if plan.lead == plan.index else self.choices[plan.lead]))
        self.items: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self.left = len(plans)  # choices whose last event the answer has not read
        self.gone = False
        self.failure: APIError | None = None  # a lead's first event failed: the request's status
        self._opening = sum(c.lead is None for c in self.choices)
        self._opened = asyncio.Event()

    def start(self) -> None:
        for c in self.choices:
            c.task = asyncio.create_task(self._run(c))

    async def opened(self) -> OutputEvent:
        """Once every lead has its first event: the first event of choice 0 (its worker answers); else
        the first lead failure, as the request's error."""
        await self._opened.wait()
        if self.failure is not None:
            raise self.failure
        first = self.choices[0].first.result()
        assert isinstance(first, OutputEvent)
        return first

    @property
    def decision_id(self) -> str | None:
        return self.choices[0].decision_id

    async def next(self) -> tuple[int, OutputEvent]:
        """The next event of any choice, with its index; raises a choice's failure."""
        index, item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        if item.is_last:
            self.left -= 1
        return index, item

    def ready(self) -> int:
        """How many items `next` returns without waiting."""
        return self.items.qsize()

    def renderers(self) -> list[ChoiceRenderer]:
        return [ChoiceRenderer(plan.spec, plan.index) for plan in self.plans]

    def usage(self, last: dict[int, OutputEvent]) -> dict[str, object]:
        return choices_usage(self.plans, last)

    def client_gone(self) -> None:
        """The client disconnected: every choice ends (`ClientGone`)."""
        self.gone = True
        for c in self.choices:
            if c.reader is not None:
                c.reader.events.client_gone()

    async def close(self) -> None:
        """Stop every choice; cancel each job not ended. Idempotent."""
        tasks = [c.task for c in self.choices if c.task is not None and not c.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        stale = [c for c in self.choices if c.reader is not None and not c.ended]
        for c in stale:
            c.ended = True
        if stale:
            await asyncio.gather(*(c.reader.cancel() for c in stale if c.reader is not None))

    # -- one choice -------------------------------------------------------------------------------------
    async def _run(self, c: Choice) -> None:
        try:
            if c.lead is not None and not isinstance(await asyncio.shield(c.lead.first), OutputEvent):
                return  # its prompt's lead failed: so did the request
            if self.gone:
                raise ClientGone()
            reader = c.reader = await self._started(c)
            if self.gone:
                reader.events.client_gone()
            await self._relay(c, reader)
        except asyncio.CancelledError:
            raise
        except (APIError, ClientGone) as e:
            await self._failed(c, e)
        except (RedisError, TimeoutError) as e:
            log.warning("choice %d failed on Redis: %r", c.plan.index, e)
            await self._failed(c, queue_unavailable())
        except Exception:
            log.exception("choice %d failed", c.plan.index)
            await self._failed(c, APIError(500, "Internal server error.", type_="server_error"))

    async def _started(self, c: Choice) -> OutputReader:
        """Its job, started; a choice stopped meanwhile has the job cancelled once it is started (the
        start itself is not interrupted: admission and enqueueing account for what they did). That
        cancel runs before this choice's task ends, so `close`, which awaits the task, returns with the
        job's reservation released and the job dropped (a client, or a test, sees it all ended); only a
        second stop while it waits leaves the cancel to a task of its own."""
        start = asyncio.ensure_future(self._start(c))
        try:
            return await asyncio.shield(start)
        except asyncio.CancelledError as stopped:
            try:
                reader = await asyncio.shield(start)
            except asyncio.CancelledError:
                start.add_done_callback(_cancel_started)
                raise
            except Exception:
                raise stopped from None  # not started: nothing queued, nothing held
            c.reader, c.ended = reader, True
            await reader.cancel()
            raise

    async def _start(self, c: Choice) -> OutputReader:
        ctx, job, prompt, base = self.ctx, c.plan.job, c.plan.prompt, self.resolved.target.base
        if await job.is_retry(ctx):
            return await attach(ctx, job, base)
        charge = await admit(ctx, self.request, self.call.tenant, base, prompt)
        decision, reservation = route(ctx, route_input(job, self.resolved, prompt), charge)
        c.decision_id = decision.decision_id
        reader = await enqueue(ctx, job, decision, reservation, charge)
        if reader.reservation is not None:  # else attached to a copy queued first: its handler accounts
            target = self.resolved.target
            c.finish = Finish(ctx, self.call, job.request_id, target, decision, charge, self.started)
        return reader

    async def _relay(self, c: Choice, reader: OutputReader) -> None:
        """Hand every event to the answer, in order; the job ends with its last one."""
        settings = self.ctx.settings
        try:
            event = await reader.next(settings.first_event_timeout_s)
        finally:
            reader.first_token()
        first_at = time.monotonic()
        if event.error is not None and c.lead is None:  # as for one choice: its status is the request's
            c.ended = True
            reader.finish()
            raise worker_error(event.error, 400)
        self._opened_by(c, event)
        while True:
            if event.is_last:
                c.ended = True
                reader.finish()
                if event.error is None:
                    c.finish(event, first_at)
            self.items.put_nowait((c.plan.index, event))
            if event.is_last:
                return
            event = await reader.next(settings.request_timeout_s)

    async def _failed(self, c: Choice, error: APIError | ClientGone) -> None:
        if c.reader is not None and not c.ended:
            await c.reader.cancel()
            c.ended = True
        self._opened_by(c, error if isinstance(error, APIError) else client_closed())
        self.items.put_nowait((c.plan.index, error))

    def _opened_by(self, c: Choice, first: OutputEvent | APIError) -> None:
        """A lead's first event (or failure) arrived: its siblings may start, and once every lead's has
        (or one failed), the answer may."""
        if c.lead is not None or c.first.done():
            return
        c.first.set_result(first)
        if isinstance(first, APIError) and self.failure is None:
            self.failure = first
        self._opening -= 1
        if self.failure is not None or not self._opening:
            self._opened.set()


def _cancel_started(start: asyncio.Future[OutputReader]) -> None:
    if start.cancelled() or start.exception() is not None:
        return  # not started: nothing queued, nothing held
    task = asyncio.ensure_future(start.result().cancel())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)
