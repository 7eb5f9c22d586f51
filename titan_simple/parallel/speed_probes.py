"""How fast this machine is: how long a matmul, a copy and an all-gather take, and the slowest rank's figures.

Each caller keeps its own method (sizes, repetitions, mean or median or least, barriers or not) and its own formulas
on top; only the pieces are here, below ``dry_run/`` because Inductor's CPU runtime model is calibrated with them
in every compiling process:

* ``CpuRuntimeEstimator.calibrate`` (``compile/cpu_cost_model.py``): Inductor's CPU runtime model;
* ``measure_rates`` (``dry_run/cpu_measurement.py``): the rates the dry run is checked against;
* ``measure_cpu`` (``dry_run/hardware.py``): this CPU as the dry run's ``DeviceSpec``;
* ``matmul_flops_per_second`` (``scripts/benchmarks/benchmark.py``): the matmul rate MFU is taken against.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

FP32_BYTES = 4


def seconds_per_call(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of ``fn()`` over ``reps`` back-to-back calls under one timer."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def seconds_of_each_call(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
                         ) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()``, timed alone; ``before()`` runs untimed before each."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Inside, torch's intra-op thread count is ``n``; the previous count is restored on exit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def matmul_flops(n: int) -> int:
    """FLOPs of an ``n x n`` by ``n x n`` matmul (a multiply-add is 2)."""
    return 2 * n**3


def copy_bytes(numel: int) -> int:
    """Bytes a copy of ``numel`` fp32 elements moves: each is read once and written once."""
    return 2 * numel * FP32_BYTES


def matmul_seconds(n: int, reps: int, *, least: bool = False, barrier: bool = False) -> float:
    """Seconds of one ``n x n`` fp32 matmul after one untimed warm-up call: the mean of ``reps`` back-to-back
    calls, or with ``least`` the least of ``reps`` calls timed alone. ``barrier``: every rank of the default
    process group starts timing together (after the warm-up)."""
    a = torch.randn(n, n)
    torch.mm(a, a)
    if barrier:
        dist.barrier()
    if least:
        return min(seconds_of_each_call(lambda: torch.mm(a, a), reps))
    return seconds_per_call(lambda: torch.mm(a, a), reps)


def copy_seconds(numel: int, reps: int, *, warmup: bool = True, barrier: bool = False) -> float:
    """Mean seconds of one copy (``clone``) of ``numel`` fp32 elements over ``reps`` back-to-back calls, after
    one untimed warm-up call unless ``warmup=False``. ``barrier``: as for ``matmul_seconds``."""
    b = torch.randn(numel)
    if warmup:
        b.clone()
    if barrier:
        dist.barrier()
    return seconds_per_call(b.clone, reps)


def all_gather_seconds(numel: int, reps: int, group: dist.ProcessGroup | None = None, *,
                       single_calls: bool = False) -> float:
    """Seconds of one gloo all-gather of ``numel`` fp32 elements per rank, after one untimed warm-up call: the
    mean of ``reps`` back-to-back calls, or with ``single_calls`` the median of ``reps`` calls each timed
    alone after a barrier (a descheduled process skews a mean, not a median)."""
    x, out = torch.ones(numel), torch.empty(numel * dist.get_world_size(group))

    def gather() -> None:
        dist.all_gather_single(out, x, group=group)

    gather()  # warm-up
    if single_calls:
        return statistics.median(seconds_of_each_call(gather, reps, before=lambda: dist.barrier(group=group)))
    return seconds_per_call(gather, reps)


def max_over_ranks(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (for times: the slowest rank's), so that every rank
    ends up with the same figures; the values unchanged without a process group of more than one rank."""
    stats = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return stats.tolist()
