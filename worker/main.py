"""`loragate worker`: load a base model, join the fleet through Redis, serve until SIGTERM (then drain)."""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import redis
import torch

from loragate import contracts
from loragate.proc import exit_on_stop_signal, install_stop_handler
from loragate.redis_url import connect_sync
from loragate.tracing import make_provider
from worker.config import EngineConfig
from worker.device import SWITCH, add_device_args, add_switch, device_args, dtype_name
from worker.engine import LLMEngine
from worker.heartbeat import Heartbeat
from worker.metrics import serve_metrics
from worker.registry import AdapterRegistry
from worker.service import WorkerService


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loragate worker", description=__doc__)
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--model-name", help="name clients use for this base model (default: the directory name)")
    p.add_argument("--adapters", help="directory of PEFT adapters to register as {model-name}:{subdir}")
    p.add_argument("--pin", action="append", default=[], help="adapter (subdir name) to keep resident")
    p.add_argument("--redis", help="Redis URL (default: $REDIS_URL)")
    p.add_argument("--worker-id", help="stable id of this worker (default: {model-name}-{hostname})")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        help="KV cache size (default: what --max-num-seqs full-length sequences need, capped at 85%% of free "
        "GPU memory or 25%% of available host memory)",
    )
    p.add_argument(
        "--kv-prefault",
        choices=("on", "off"),
        default="on",
        help="on a CPU, commit the KV pool's memory at start (default), not as the first requests write it",
    )
    add_device_args(p)
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for the engine's math (default: every core; several CPU workers on one machine "
        "should split the cores, as `loragate up` does)",
    )
    add_switch(
        p, "--warmup", "compile the kernels for every batch shape before taking requests (auto: on a GPU)"
    )
    add_switch(
        p, "--cuda-graphs", "replay whole-decode steps from CUDA graphs captured at start (auto: on a GPU)"
    )
    add_switch(
        p,
        "--overlap-writes",
        "send each step's output events while the engine computes the next step (auto: on a GPU, or with "
        "--threads below the cores this process may use)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address for the metrics port")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_stop_signal()  # until the service runs there is nothing to drain: stop at once
    parser = build_parser()
    args = parser.parse_args(argv)
    device, dtype = device_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = Path(args.model)
    name = args.model_name or model_dir.name
    try:
        contracts.check_model_name(name)
    except ValueError as e:
        parser.error(str(e))
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    worker_id = args.worker_id or f"{name}-{socket.gethostname()}"
    r: redis.Redis = connect_sync(args.redis)  # no retry: its output transactions must not run twice
    engine = LLMEngine(
        model_dir,
        EngineConfig(
            max_loras=args.max_loras,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=args.kv_cache_mb * 1024**2 if args.kv_cache_mb else None,
            kv_prefault=args.kv_prefault == "on",
            device=device,
            dtype=dtype,
            warmup=SWITCH[args.warmup],
            cuda_graphs=SWITCH[args.cuda_graphs],
        ),
    )
    logging.getLogger("loragate.worker").info(
        "engine on %s (%s), %d CPU threads", device, dtype_name(dtype), torch.get_num_threads()
    )
    if engine.warmup is not None:
        logging.getLogger("loragate.worker").info(
            "warm-up: %d steps in %.1f s", engine.warmup.steps, engine.warmup.seconds
        )
    registry = AdapterRegistry(r, name)
    if args.adapters:  # published when the service (re)joins the fleet: Redis may be down right now
        registry.directory = (Path(args.adapters), tuple(args.pin))
    provider = make_provider("loragate-worker")
    tracer = provider.get_tracer("loragate.worker") if provider is not None else None
    # The heartbeat has a connection of its own, so it never waits behind the engine loop's commands.
    beats = Heartbeat(connect_sync(args.redis, socket_timeout=2.0, idempotent=True), worker_id, name)  # SETs
    service = WorkerService(
        engine,
        r,
        worker_id,
        name,
        registry,
        tracer=tracer,
        heartbeat=beats,
        overlap_writes=SWITCH[args.overlap_writes],
    )
    # The model and torch's own objects live as long as the process: out of the cyclic GC's sight, a full
    # collection no longer rescans them between engine steps.
    gc.collect()
    gc.freeze()
    if args.metrics_port:
        serve_metrics(engine, worker_id, args.metrics_port, args.metrics_host)

    def on_term(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("loragate.worker").info("draining (signal %d)", signum)
        service.drain()

    install_stop_handler(on_term)  # SIGTERM, SIGINT (even if inherited as ignored) and SIGHUP all drain
    logging.getLogger("loragate.worker").info(
        "worker %s serving %s from %s on %s (%s)", worker_id, name, model_dir, device, dtype_name(dtype)
    )
    service.run()
    if provider is not None:
        provider.shutdown()  # flush batched spans before exiting
    return 0


if __name__ == "__main__":
    sys.exit(main())
