"""Runtime estimates for Inductor's overlap scheduler on CPU, where its own need triton / CUDA.

The overlap scheduler (``auto`` bucketing, or reordering with bucketing ``none``) decides what to overlap from
estimated op runtimes. On GPU Inductor has its own estimates (an analytical NCCL model, benchmarked compute).
On CPU, ``CpuRuntimeEstimator`` goes into the scheduler's ``custom_runtime_estimation`` hook instead. A
collective takes latency + bytes / bandwidth, fitted on the live process group, and a compute op takes FLOPs /
a measured matmul rate.

The scheduler also calls Inductor's roofline helpers for every compute node, custom estimator or not, and these
ask triton / CUDA for peak FLOP/s and DRAM bandwidth. ``cpu_roofline`` points them at the measured rates, which
**patches two functions of the torch module** ``torch.utils._runtime_estimation`` (process-wide) while our
pass runs and restores them afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import fx

from titan_simple.compile.comm_plan import COLLECTIVE_KINDS, collective_bytes, meta_value
from titan_simple.compile.inductor_private import is_compute_node, runtime_estimation, tree_map
from titan_simple.parallel import speed_probes as timing


class CpuRuntimeEstimator:
    """``custom_runtime_estimation(node, override_size) -> ms``. Collectives are priced from a latency +
    bandwidth fit made on the live process group, matmul-like ops from their FLOPs at a measured rate.
    Everything else gets ``None``, which the scheduler treats as free. The estimator holds only picklable
    numbers, so every rank has the same one."""

    def __init__(self, latency_ms: float, bytes_per_ms: float, flops_per_ms: float, mem_bytes_per_ms: float):
        self.latency_ms, self.bytes_per_ms = latency_ms, bytes_per_ms
        self.flops_per_ms, self.mem_bytes_per_ms = flops_per_ms, mem_bytes_per_ms

    @classmethod
    def calibrate(cls, group: dist.ProcessGroup | None = None) -> CpuRuntimeEstimator:
        """Time a few all-gathers and a matmul. Every rank then takes the slowest rank's figures (all_reduce
        MAX), so that all ranks make the same scheduling decisions.

        The method differs from ``dry_run.cpu_measurement.measure_rates`` on purpose: this runs in every compiling
        process, so it stays cheap (the mean of a few back-to-back calls, no barriers between them), and the
        scheduler needs only a rough fit; ``measure_rates`` is the check of the dry run against reality and
        pays for barriers and medians of single calls."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        sizes = (1 << 10, 1 << 20)  # elements (fp32): 4 KiB and 4 MiB per rank
        times = [timing.all_gather_seconds(n, 5, group) * 1e3 if world > 1 else 0.0 for n in sizes]
        matmul_n, copy_numel = 256, 1 << 20
        mm_ms = timing.matmul_seconds(matmul_n, 10) * 1e3
        copy_ms = timing.copy_seconds(copy_numel, 5, warmup=False) * 1e3
        # Slowest rank wins: max of times (so min of rates).
        t_small, t_big, mm_ms, copy_ms = timing.max_over_ranks([*times, mm_ms, copy_ms], group)
        bytes_small, bytes_big = sizes[0] * 4 * world, sizes[1] * 4 * world
        bytes_per_ms = (bytes_big - bytes_small) / max(t_big - t_small, 1e-6)
        latency_ms = max(t_small - bytes_small / bytes_per_ms, 1e-3)
        flops_per_ms = timing.matmul_flops(matmul_n) / max(mm_ms, 1e-6)
        mem_bytes_per_ms = timing.copy_bytes(copy_numel) / max(copy_ms, 1e-6)
        return cls(latency_ms, bytes_per_ms, flops_per_ms, mem_bytes_per_ms)

    def collective_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms

    def __call__(self, node: fx.Node, override_size: int | None = None) -> float | None:
        if node.op != "call_function":
            return None
        if node.target in COLLECTIVE_KINDS:
            return self.collective_ms(override_size if override_size is not None else collective_bytes(node))
        if is_compute_node(node):
            flops = _node_flops(node)
            return None if flops is None else flops / self.flops_per_ms
        return None


@contextlib.contextmanager
def cpu_roofline(estimator: CpuRuntimeEstimator | None) -> Iterator[None]:
    """Within the block, Inductor's roofline helpers answer with the measured rates (nominal ones without an
    estimator) instead of asking triton / CUDA. The overlap schedulers call them for every compute node, even
    with a custom estimator, and so does the manual scheduler, which ignores the estimates. This replaces
    ``get_device_tflops`` / ``get_gpu_dram_gbps`` on the ``torch.utils._runtime_estimation`` module for the
    whole process and restores them on exit."""
    flops_per_ms = estimator.flops_per_ms if estimator else 1e8  # nominal: 100 GFLOP/s, 10 GB/s
    bytes_per_ms = estimator.mem_bytes_per_ms if estimator else 1e7
    tflops = flops_per_ms * 1e3 / 1e12 / 0.75  # flops_to_ns divides by 0.75 * peak
    gbps = bytes_per_ms * 1e3 / 1e9
    saved = runtime_estimation.get_device_tflops, runtime_estimation.get_gpu_dram_gbps
    runtime_estimation.get_device_tflops = lambda dtype: tflops
    runtime_estimation.get_gpu_dram_gbps = lambda: gbps
    try:
        yield
    finally:
        runtime_estimation.get_device_tflops, runtime_estimation.get_gpu_dram_gbps = saved


def _node_flops(node: fx.Node) -> int | None:
    """FLOPs of ``node`` from torch's FLOP-counter formulas on its fake values; ``None`` if it has none."""
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(node.target, "overloadpacket", None)) or flop_registry.get(node.target)
    if fn is None:
        return None
    args, kwargs, out = tree_map(meta_value, (node.args, node.kwargs, node))
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 -- a shape we cannot price: let the scheduler treat it as free
        return None
