"""Measure what the dry run predicts, on real processes (CPU, gloo): the check of the model against reality.

``measure_worker`` runs inside each of N spawned processes: it measures this machine's rates *while all N
processes run* (matmul FLOP/s, copy bandwidth, gloo all-gather bandwidth), builds the model exactly as the
trainer does, times a few training steps, and traces one more step with the dry run's own ``StepTracer`` on
real tensors (peak live tensor storage bytes, and every collective issued). Rank 0 writes the result as JSON.
``scripts/dry_run_cpu_check.py`` and ``tests/test_dry_run.py`` use it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401 -- registers the _c10d_functional ops activation_checkpoint names
from torch import nn

from titan_simple.config import load_job_config
from titan_simple.models.llama3 import build_model
from titan_simple.parallel.dims import ParallelDims
from titan_simple.parallel.parallelize import parallelize_llama, uses_loss_parallel
from titan_simple.parallel.sharded_init import materialize_and_init
from titan_simple.parallel.simple_fsdp import clip_grad_norm_
from titan_simple.parallel.tensor_parallel import loss_parallel_context
from titan_simple.planning.trace import StepTracer, ignoring_shape_propagation
from titan_simple.train.optim import build_optimizer


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_rates(world_size: int) -> dict[str, float]:
    """Matmul FLOP/s and copy bytes/s with every rank computing at once (they share the cores), and the
    all-gather bus bandwidth (bytes/s of the formula ``(n-1)/n x gathered bytes / time``) and latency."""
    a = torch.randn(512, 512)
    b = torch.randn(1 << 22)
    torch.mm(a, a)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    mm_s = (time.perf_counter() - start) / 20
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        b.clone()
    copy_s = (time.perf_counter() - start) / 10
    times = []
    for n, reps in ((1 << 8, 21), (1 << 20, 5)):  # fp32 elements per rank: 1 KiB and 4 MiB
        x, out = torch.ones(n), torch.empty(n * world_size)
        dist.all_gather_single(out, x)
        each = []
        for _ in range(reps):  # the median of single calls: a descheduled process skews a mean
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_single(out, x)
            each.append(time.perf_counter() - start)
        times.append(statistics.median(each))
    mm_s, copy_s, small_s, big_s = _max_over_ranks([mm_s, copy_s, *times])
    wire = (world_size - 1) / world_size * 4 * world_size
    bandwidth = wire * ((1 << 20) - (1 << 8)) / max(big_s - small_s, 1e-9)
    return {"matmul_flops": 2 * 512**3 / mm_s, "memory_bandwidth": 2 * b.numel() * 4 / copy_s,
            "allgather_bandwidth": bandwidth, "allgather_latency": max(small_s - wire * (1 << 8) / bandwidth, 0.0)}


def measure_worker(rank: int, world_size: int, argv: list[str], out_path: str, steps: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = _measure(rank, world_size, argv, steps)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world_size: int, argv: list[str], steps: int) -> dict[str, Any]:
    config = load_job_config(argv)
    t, p = config.training, config.parallelism
    dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
                        p.pipeline_parallel_degree, world_size)
    rates = measure_rates(world_size)
    mesh = dims.build_mesh("cpu")
    device = torch.device("cpu")
    model = build_model(config.model.flavor, max_seq_len=t.seq_len, device="meta")
    model = parallelize_llama(model, dims, mesh, config, device)
    materialize_and_init(model, device, t.seed)
    o = config.optimizer
    optimizer = build_optimizer(nn.ModuleList([model]), name=o.name, lr=o.lr, eps=o.eps,
                                weight_decay=o.weight_decay, implementation=o.implementation)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model.args.vocab_size, (t.local_batch_size, t.seq_len + 1), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss_parallel = uses_loss_parallel(dims, config)
    from titan_simple.train.trainer import cross_entropy_sum

    def step(tracer: StepTracer | None = None, tokens: int | None = None) -> None:
        optimizer.zero_grad(set_to_none=False)  # steady state: gradients stay allocated, as the dry run assumes
        if tracer:
            tracer.set_phase("forward")
        x, y = (inputs, labels) if tokens is None else (inputs[:1, :tokens], labels[:1, :tokens])
        logits = model(x)
        with loss_parallel_context(loss_parallel):
            loss = cross_entropy_sum(logits, y) / y.numel()
            if tracer:
                tracer.set_phase("backward")
            loss.backward()
        del logits, loss
        if tracer:  # clipping's small all-reduces count with the optimizer (the dry run does not clip)
            tracer.set_phase("optimizer")
        clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()

    def timed(tokens: int | None) -> list[float]:
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step(tokens=tokens)
            dist.barrier()
            times.append(time.perf_counter() - start)
        return times

    step()  # creates gradients and optimizer state
    times = timed(None)
    # Per-op overhead (Python, autograd, DTensor dispatch, launch): a step on 8 tokens, whose compute is ~0,
    # less its collectives' latency (priced separately), divided by the ops the dry run prices in it.
    tiny = timed(8)
    op_counter = StepTracer(ignore_meta_tensors=True)
    with op_counter, ignoring_shape_propagation():
        step(op_counter, tokens=8)
    latency = len(op_counter.collectives) * rates["allgather_latency"]
    rates["op_overhead"] = max(statistics.median(tiny) - latency, 0.0) / len(op_counter.ops)
    tracer = StepTracer(ignore_meta_tensors=True)
    with tracer, ignoring_shape_propagation():
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for tensor in [*model.parameters(), *(q.grad for q in model.parameters()), *state, *model.buffers(),
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
