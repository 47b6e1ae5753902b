"""A token-emitting load worker, for load tests only: the worker's Redis protocol without a model.

`LoadWorker` stands in for `worker.service.WorkerService` where a benchmark needs far more concurrent
sequences than a CPU engine can run (the gateway's concurrent-streams measurement in
`loadtest.bench_gateway`). It speaks the real worker's protocol exactly: it reads `lg:q:{id}` in the
consumer group `workers` (its own pending entries first, as after a restart), heartbeats a `WorkerState`
with a TTL at `lg:w:{id}` (with a real model directory, whose tokenizer the gateway loads), appends one
`OutputEvent` per token to `lg:out:{request_id}` with usage figures, the last one with a finish reason,
and only then `XACK`s and `XDEL`s the queue entry; a request id published on `lg:cancel` ends that
sequence with `finish_reason="abort"`. Instead of running a model it emits `max_tokens` fake tokens, one
every `interval_s`. All sequences due at a tick are written in one pipeline, as the real worker writes
one engine step's events. With `max_running` it runs at most that many sequences at once (a real
worker's `--max-num-seqs`) and the rest waits in its queue stream: a fleet with a known capacity, for the
overload benchmark (`loadtest.overload`). Tests of the worker itself must use `WorkerService`, never this.

    python -m loadtest.load_worker --worker-id load-0 --model-name tiny-load [--interval-ms 40]
                                   [--max-running N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState, streamed_so_far
from loragate.redis_url import connect_async

log = logging.getLogger("loragate.loadtest")

FAKE_KV_BLOCKS = 1 << 20  # a load worker holds no KV cache; announce plenty so no policy avoids it


def max_model_len_of(model_dir: Path) -> int:
    """The context length a worker serving `model_dir` announces (the gateway checks requests with it).

    As the real worker's: `max_position_embeddings`, a sliding window or not (the window masks keys in
    attention; it does not shorten the context)."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


@dataclass(frozen=True, slots=True)
class LoadWorkerConfig:
    worker_id: str
    model: str  # the base-model name clients ask for
    model_dir: Path  # its tokenizer is what the gateway tokenizes with
    interval_s: float = 0.04  # between two tokens of one sequence
    admit_batch: int = 512  # queue entries read per XREADGROUP
    max_running: int = 0  # sequences run at once (like a worker's --max-num-seqs); 0 = no limit
    block_ms: int = 100  # XREADGROUP BLOCK while waiting for work


@dataclass(slots=True)
class _Sequence:
    entry_id: str
    message: QueuedRequest
    remaining: int  # fake tokens still to emit
    completion_tokens: int  # emitted so far, including tokens resumed from an earlier worker
    cancelled: bool = False
    finished: bool = False

    def next_event(self, worker_id: str) -> OutputEvent:
        """One step's event: the next fake token (none once cancelled), final when none remain."""
        token_ids: tuple[int, ...] = ()
        text = ""
        if not self.cancelled and self.remaining > 0:
            token_ids = (8 + (self.completion_tokens * 31 + len(self.message.request_id)) % 4096,)
            text = f" t{self.completion_tokens}"
            self.remaining -= 1
            self.completion_tokens += 1
        finish = "abort" if self.cancelled else ("length" if self.remaining == 0 else None)
        self.finished = finish is not None
        return OutputEvent(
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            prompt_tokens=len(self.message.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            worker_id=worker_id,
        )


@dataclass
class LoadWorkerStats:
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    tokens: int = 0
    peak_running: int = 0
    ticks: int = 0
    started: float = field(default_factory=time.monotonic)


class LoadWorker:
    """A load-testing stand-in for the worker (no model, fake tokens): holds any number of concurrent
    sequences in one asyncio loop. See the module docstring; never a substitute in tests of the worker."""

    def __init__(self, r: aioredis.Redis, config: LoadWorkerConfig):
        self.redis, self.config = r, config
        self.queue = contracts.queue(config.model, config.worker_id)
        self.max_model_len = max_model_len_of(config.model_dir)
        self.active: dict[str, _Sequence] = {}
        self.stats = LoadWorkerStats()
        self._due: list[tuple[float, int, str]] = []  # heap of (due time, tie-breaker, request id)
        self._counter = 0
        self._slack_s = min(0.002, config.interval_s / 10)
        self._wake = asyncio.Event()
        self._draining = asyncio.Event()
        self._freed = asyncio.Event()  # a sequence finished: room to admit another

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until `drain()`; then finish the running sequences and remove the heartbeat."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(contracts.CANCEL)
        await self.heartbeat()
        await self._create_group()  # after the first beat, as the real worker (see gateway.reaper)
        helpers = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._cancel_loop(pubsub)),
        ]
        admit = asyncio.create_task(self._admit_loop())
        try:
            await self._admit(pending=True)
            await self._emit_loop()
        finally:
            admit.cancel()
            for task in helpers:
                task.cancel()
            for task in (admit, *helpers):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await pubsub.aclose()
            await self.redis.delete(contracts.worker_state(self.config.model, self.config.worker_id))

    def drain(self) -> None:
        self._draining.set()
        self._wake.set()

    async def _create_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.queue, contracts.WORKER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- admission --------------------------------------------------------------------------------
    def _room(self) -> int:
        if not self.config.max_running:
            return self.config.admit_batch
        return min(self.config.admit_batch, self.config.max_running - len(self.active))

    async def _admit_loop(self) -> None:
        while not self._draining.is_set():
            if self._room() <= 0:  # full: the rest waits in the queue stream, as on a real worker
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), 0.1)
                continue
            try:
                await self._admit(pending=False)
            except aioredis.RedisError:
                log.exception("load worker: admission failed; retrying")
                await asyncio.sleep(0.1)

    async def _admit(self, pending: bool) -> None:
        reply = await self.redis.xreadgroup(
            contracts.WORKER_GROUP,
            self.config.worker_id,
            {self.queue: "0" if pending else ">"},
            count=None if pending else self._room(),
            block=None if pending else self.config.block_ms,
        )
        entries = [(eid.decode(), fields) for _, items in reply or [] for eid, fields in items]
        if not entries:
            return
        messages = [QueuedRequest.from_json(fields[contracts.QUEUE_FIELD_BYTES]) for _, fields in entries]
        # As the real worker: output can already exist only after a restart or a re-route.
        resumable = [m for m in messages if pending or m.attempt > 0]
        pipe = self.redis.pipeline(transaction=False)
        for msg in resumable:
            pipe.xrange(contracts.output(msg.model, msg.request_id))
        found = dict(zip((m.request_id for m in resumable), await pipe.execute(), strict=True))
        histories = [found.get(m.request_id, []) for m in messages]
        for (entry_id, _), msg, history in zip(entries, messages, histories, strict=True):
            await self._start(entry_id, msg, history)
        self._wake.set()

    async def _start(
        self, entry_id: str, msg: QueuedRequest, history: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> None:
        streamed, _, done = streamed_so_far(history)
        if done:  # finished before a restart; only the ack was lost
            await self._ack([entry_id])
            return
        if msg.deadline and time.time() > msg.deadline:
            error = {"message": "the request's deadline passed while it was queued", "type": "timeout"}
            event = OutputEvent(worker_id=self.config.worker_id, error={**error, "code": None, "status": 504})
            await self.redis.xadd(
                contracts.output(msg.model, msg.request_id), {contracts.OUTPUT_FIELD: event.to_json()}
            )
            await self.redis.expire(contracts.output(msg.model, msg.request_id), contracts.OUTPUT_TTL_S)
            await self._ack([entry_id])
            return
        resumed = len(streamed) or len(msg.resume_token_ids)
        seq = _Sequence(entry_id, msg, max(0, msg.params.max_tokens - resumed), resumed)
        self.active[msg.request_id] = seq
        self.stats.admitted += 1
        self.stats.peak_running = max(self.stats.peak_running, len(self.active))
        self._schedule(msg.request_id, time.monotonic())

    def _schedule(self, request_id: str, due: float) -> None:
        self._counter += 1
        heapq.heappush(self._due, (due, self._counter, request_id))

    # -- output -----------------------------------------------------------------------------------
    async def _emit_loop(self) -> None:
        while not (self._draining.is_set() and not self.active):
            now = time.monotonic()
            due: dict[str, _Sequence] = {}  # a cancelled sequence can be in the heap twice
            # Sequences due within the slack go out in this tick's pipeline, not in one tick each.
            while self._due and self._due[0][0] <= now + self._slack_s:
                _, _, rid = heapq.heappop(self._due)
                seq = self.active.get(rid)
                if seq is not None and not seq.finished:
                    due[rid] = seq
            if due:
                await self._write(list(due.values()))
                for seq in due.values():
                    if not seq.finished:
                        self._schedule(seq.message.request_id, now + self.config.interval_s)
            wait = self._due[0][0] - time.monotonic() if self._due else 1.0
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    async def _write(self, due: list[_Sequence]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        finished: list[_Sequence] = []
        for seq in due:
            event = seq.next_event(self.config.worker_id)
            key = contracts.output(seq.message.model, seq.message.request_id)
            pipe.xadd(key, {contracts.OUTPUT_FIELD: event.to_json()})
            pipe.expire(key, contracts.OUTPUT_TTL_S)
            self.stats.tokens += len(event.token_ids)
            if seq.finished:
                finished.append(seq)
        await pipe.execute()  # the last events are durable before their queue entries are acknowledged
        self.stats.ticks += 1
        if finished:
            await self._ack([seq.entry_id for seq in finished])
            for seq in finished:
                del self.active[seq.message.request_id]
                self.stats.finished += 1
            self._freed.set()

    async def _ack(self, entry_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xack(self.queue, contracts.WORKER_GROUP, entry_id)
            pipe.xdel(self.queue, entry_id)
        await pipe.execute()

    async def _cancel_loop(self, pubsub: PubSub) -> None:
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                continue
            data = msg["data"]
            seq = self.active.get(data.decode() if isinstance(data, bytes) else str(data))
            if seq is not None and not seq.cancelled:
                seq.cancelled = True
                self.stats.cancelled += 1
                self._schedule(seq.message.request_id, time.monotonic())
                self._wake.set()

    # -- heartbeat --------------------------------------------------------------------------------
    def state(self, waiting: int = 0) -> WorkerState:
        elapsed = max(1e-9, time.monotonic() - self.stats.started)
        return WorkerState(
            worker_id=self.config.worker_id,
            model=self.config.model,
            model_dir=str(self.config.model_dir),
            max_model_len=self.max_model_len,
            kv_blocks_free=FAKE_KV_BLOCKS,
            kv_blocks_total=FAKE_KV_BLOCKS,
            running=len(self.active),
            waiting=waiting,
            draining=self._draining.is_set(),
            decode_tok_s=round(self.stats.tokens / elapsed, 1),
        )

    async def heartbeat(self) -> None:
        key = contracts.worker_state(self.config.model, self.config.worker_id)
        # Waiting, as a real worker reports it: requests it holds but does not run (here: still unread).
        waiting = max(0, await self.redis.xlen(self.queue) - len(self.active))
        await self.redis.set(key, self.state(waiting).to_json(), ex=contracts.HEARTBEAT_TTL_S)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(contracts.HEARTBEAT_S)
            try:
                await self.heartbeat()
            except aioredis.RedisError:
                log.exception("load worker: heartbeat failed")


async def serve(redis_url: str | None, config: LoadWorkerConfig) -> LoadWorkerStats:
    """Run one load worker until SIGTERM/SIGINT, then drain."""
    r = connect_async(redis_url, max_connections=16)
    worker = LoadWorker(r, config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain)
    try:
        await worker.run()
    finally:
        await r.aclose()
    return worker.stats


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.load_worker", description=__doc__.split("\n")[0])
    p.add_argument("--worker-id", default="load-0")
    p.add_argument("--model-name", default="tiny-load", help="the base-model name clients ask for")
    p.add_argument("--model-dir", help="checkpoint whose tokenizer the gateway uses (default: zoo tiny)")
    p.add_argument("--interval-ms", type=float, default=40.0, help="between two tokens of one sequence")
    p.add_argument("--max-running", type=int, default=0, help="sequences run at once (0: no limit)")
    p.add_argument("--redis", help="Redis URL (default: $REDIS_URL)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from worker.modelzoo.make import ensure_zoo

        model_dir = ensure_zoo().base("tiny")
    config = LoadWorkerConfig(
        args.worker_id, args.model_name, model_dir, args.interval_ms / 1000, max_running=args.max_running
    )
    log.info(
        "load worker %s (fake tokens every %.0f ms) as %s",
        config.worker_id,
        args.interval_ms,
        args.model_name,
    )
    stats = asyncio.run(serve(args.redis, config))
    log.info("load worker %s stopped: %s", config.worker_id, stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
