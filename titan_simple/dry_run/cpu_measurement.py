"""Measure what the dry run predicts, on real processes (CPU, gloo): the check of the model against reality.

``measure_worker`` runs inside each of N spawned processes: it measures this machine's rates *while all N
processes run* (matmul FLOP/s, copy bandwidth, gloo all-gather bandwidth), builds the model and its training step with
the trainer's own functions, times a few steps, and traces one more step with the dry run's own ``StepTracer`` on
real tensors (peak live tensor storage bytes, and every collective issued). Rank 0 writes the result as JSON.
``scripts/benchmarks/dry_run_cpu_check.py`` and ``tests/test_dry_run.py`` use it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401 -- registers the _c10d_functional ops activation_checkpoint names

from titan_simple.config import load_job_config
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import resolve_plan
from titan_simple.core.step import StepHooks
from titan_simple.dry_run.tracer import StepTracer, ignoring_shape_propagation
from titan_simple.parallel import speed_probes as probes
from titan_simple.parallel.torch_private import use_one_gloo_worker_thread


def measure_rates(world_size: int) -> dict[str, float]:
    """Matmul FLOP/s and copy bytes/s with every rank computing at once (they share the cores), and the
    all-gather bus bandwidth (bytes/s of the formula ``(n-1)/n x gathered bytes / time``) and latency.

    Every rank starts each timing together (barriers), and an all-gather's time is the median of single calls:
    a descheduled process skews a mean. (``CpuRuntimeEstimator.calibrate`` times the same things more cheaply,
    for Inductor's scheduler; its docstring says why.)"""
    matmul_n, copy_numel = 512, 1 << 22
    mm_s = probes.matmul_seconds(matmul_n, 20, barrier=True)
    copy_s = probes.copy_seconds(copy_numel, 10, warmup=False, barrier=True)
    # fp32 elements per rank: 1 KiB and 4 MiB
    times = [probes.all_gather_seconds(n, reps, single_calls=True) for n, reps in ((1 << 8, 21), (1 << 20, 5))]
    mm_s, copy_s, small_s, big_s = probes.max_over_ranks([mm_s, copy_s, *times])
    wire = (world_size - 1) / world_size * 4 * world_size
    bandwidth = wire * ((1 << 20) - (1 << 8)) / max(big_s - small_s, 1e-9)
    return {"matmul_flops": probes.matmul_flops(matmul_n) / mm_s,
            "memory_bandwidth": probes.copy_bytes(copy_numel) / copy_s,
            "allgather_bandwidth": bandwidth, "allgather_latency": max(small_s - wire * (1 << 8) / bandwidth, 0.0)}


def measure_worker(rank: int, world_size: int, argv: list[str], out_path: str, steps: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    use_one_gloo_worker_thread()  # as the trainer does (trainer/distributed.py)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = _measure(rank, world_size, argv, steps)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Phases(StepHooks):
    """Tells the tracer the step's phase (clipping's small all-reduces count with the optimizer: the dry run does
    not clip)."""

    def __init__(self, tracer: StepTracer) -> None:
        self.tracer = tracer

    def phase(self, name: str) -> None:
        self.tracer.set_phase(name)


def _timed(step: Callable[..., None], steps: int, tokens: int | None) -> list[float]:
    """``steps`` steps' seconds, each between barriers (the slowest rank's time)."""
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(tokens=tokens)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _measure(rank: int, world_size: int, argv: list[str], steps: int) -> dict[str, Any]:
    config = load_job_config(argv)
    training = config.training
    device = torch.device("cpu")
    plan = resolve_plan(config, world_size, device.type)  # the trainer's plan, build and step
    rates = measure_rates(world_size)
    # Gradients stay allocated between steps (the steady state the dry run assumes).
    run = build_run(plan, device, lr_schedule=False, keep_grad_buffers=True)
    parts, optimizer, train_step = run.parts, run.optimizer, run.step
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, parts.model_args.vocab_size, (training.local_batch_size, training.seq_len + 1),
                           generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step(tracer: StepTracer | None = None, tokens: int | None = None) -> None:
        train_step.hooks = _Phases(tracer) if tracer else StepHooks()
        x, y = (inputs, labels) if tokens is None else (inputs[:1, :tokens], labels[:1, :tokens])
        train_step([(x, y)])

    step()  # creates gradients and optimizer state
    times = _timed(step, steps, None)
    # Per-op overhead (Python, autograd, DTensor dispatch, launch): a step on 8 tokens, whose compute is ~0,
    # less its collectives' latency (priced separately), divided by the ops the dry run prices in it.
    tiny = _timed(step, steps, 8)
    op_counter = StepTracer(ignore_meta_tensors=True)
    with op_counter, ignoring_shape_propagation():
        step(op_counter, tokens=8)
    latency = len(op_counter.collectives) * rates["allgather_latency"]
    rates["op_overhead"] = max(statistics.median(tiny) - latency, 0.0) / len(op_counter.ops)
    tracer = StepTracer(ignore_meta_tensors=True)
    with tracer, ignoring_shape_propagation():
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for tensor in [*parts.parameters(), *(q.grad for q in parts.parameters()), *state,
                       *parts.as_module().buffers(),
                       inputs, labels]:
            tracer.track(tensor)
        tracer.reset_peaks()
        step(tracer)
    counts = Counter((c.kind, c.dtype) for c in tracer.collectives if c.phase != "optimizer")
    return {
        "world_size": world_size,
        "rates": rates,
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
        "peak_bytes": tracer.peak,
        "phase_peaks": tracer.phase_peaks,
        "collective_counts": {f"{k}/{d}": n for (k, d), n in sorted(counts.items())},
    }


def measure(world_size: int, argv: list[str], steps: int = 3, port: int = 29731) -> dict[str, Any]:
    """Spawn ``world_size`` gloo processes running ``measure_worker``; return rank 0's measurements."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "measure.json")
        mp.start_processes(measure_worker, args=(world_size, argv, out_path, steps, port), nprocs=world_size,
                           start_method="spawn")
        with open(out_path) as f:
            return json.load(f)
