"""Accelerator and interconnect figures the dry run's roofline uses, and how to measure them on this CPU.

Peaks are vendor datasheet figures (dense, no sparsity). The ``*_efficiency`` factors are the fraction of a
peak that real kernels reach: they are set once here, a priori from public kernel benchmarks (NOT fitted).
``GiB`` figures are the usable capacity ``nvidia-smi`` reports.

Three figures model what a real GPU job adds on top of the roofline and the tensors (``GPU_RUNTIME``), one set
for every case and every GPU:

* ``achieved_fraction`` and ``allocator_overhead`` are FITTED on one published run, TorchTitan's SimpleFSDP on
  Llama 3 8B (8 H100, FSDP8, local batch 1 x 8192, selective AC, compiled; torchtitan pull request 1881):
  published 7,227 tokens/s/GPU and 40.96 GiB reserved, where the roofline and the tensor peak predict 8,535 and
  37.0 GiB. The fraction covers what a roofline leaves out (H100 clocks under the 700 W cap, kernel launch gaps,
  allocator stalls); the overhead is the CUDA caching allocator's reserve and fragmentation, which the published
  figures (``torch.cuda.max_memory_reserved``) include. Every other published case in ``docs/dry_run.md`` is held
  out: it was not used to set them.
* ``runtime_bytes`` is not fitted (no published figure isolates it): the CUDA context (~0.5 GiB with lazy module
  loading) and NCCL's communicator buffers (~0.25 GiB per communicator; a 3-4 dimensional mesh makes a few), which
  live outside the allocator. It only enters the "fits" check, not the comparison with published reserved peaks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_simple.core.device_peaks import PEAK_BF16_TFLOPS, PEAK_FLOAT8_TFLOPS
from titan_simple.parallel.speed_probes import copy_bytes, copy_seconds, matmul_flops, matmul_seconds, torch_threads

if TYPE_CHECKING:
    from titan_simple.config import DryRun

GIB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense matmul FLOP/s in the compute dtype (bf16 on GPUs, fp32 on the CPU)
    memory_bandwidth: float  # HBM (or DRAM) bytes/s
    memory_bytes: float  # capacity of one device
    intra_node_bandwidth: float  # bytes/s per direction per device (NVLink; shared memory for CPU processes)
    inter_node_bandwidth: float  # bytes/s per device across nodes (InfiniBand / RoCE NIC per GPU)
    gpus_per_node: int = 8
    # Fractions of the peaks real kernels reach (see the module docstring).
    matmul_efficiency: float = 0.70  # large bf16 GEMMs (cuBLAS on H100: ~650-750 of 989 TFLOP/s)
    attention_efficiency: float = 0.45  # FlashAttention-2 forward+backward on H100 (~350-450 TFLOP/s fwd)
    memory_efficiency: float = 0.80  # elementwise kernels vs HBM peak
    collective_efficiency: float = 0.80  # NCCL bus bandwidth vs link peak
    collective_latency: float = 20e-6  # seconds per collective call (launch + ring latency)
    kernel_overhead: float = 5e-6  # seconds per eager kernel launch that GPU work cannot hide
    # What a real job adds (see the module docstring): 1 / 0 / 0 on the CPU, whose rates are measured.
    achieved_fraction: float = 1.0  # predicted tokens/s = roofline tokens/s x this
    allocator_overhead: float = 0.0  # reserved peak = tensor peak x (1 + this)
    runtime_bytes: float = 0.0  # CUDA context + NCCL buffers, outside the allocator
    float8_peak_flops: float | None = None  # dense float8 (e4m3) matmul FLOP/s; None: no float8 matmuls
    float8_matmul_efficiency: float = 0.70  # float8 GEMMs (torch._scaled_mm); GPUs: FLOAT8_MATMUL_EFFICIENCY, fitted
    intra_node_link: str = "NVLink"  # what the printout calls a link within a node


# Fitted on the SimpleFSDP 8B run (module docstring): 7,227 / 8,535 and 40.96 / 37.0 - 1.
ACHIEVED_FRACTION = 0.847
ALLOCATOR_OVERHEAD = 0.107
# FITTED on one published float8 run, TorchTitan's Llama 3.1 8B on 8 H100 (FSDP8, local batch 2 x 8192, selective
# AC, compiled, float8 tensorwise: 8,532 tokens/s/GPU): with the achieved fraction above, the float8 GEMMs must run at
# 0.58 of the 1,979 TFLOP/s float8 peak (a priori, as bf16's 0.70, the dry run predicted 9,197). The 70B and 405B
# float8 runs are held out (docs/dry_run.md).
FLOAT8_MATMUL_EFFICIENCY = 0.58
GPU_RUNTIME = {"achieved_fraction": ACHIEVED_FRACTION, "allocator_overhead": ALLOCATOR_OVERHEAD,
               "runtime_bytes": 1.5 * 1024**3, "float8_matmul_efficiency": FLOAT8_MATMUL_EFFICIENCY}


DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s total = 450 GB/s per direction,
    # one 400 Gb/s NIC per GPU = 50 GB/s.
    "h100": DeviceSpec("H100 SXM 80GB", PEAK_BF16_TFLOPS["H100 SXM"] * 1e12, 3.35e12, 79.6 * GIB, 450e9, 50e9,
                       float8_peak_flops=PEAK_FLOAT8_TFLOPS["H100 SXM"] * 1e12, **GPU_RUNTIME),
    # H200 SXM 141GB: the H100's compute with 4.8 TB/s HBM3e.
    "h200": DeviceSpec("H200 SXM 141GB", PEAK_BF16_TFLOPS["H200"] * 1e12, 4.8e12, 140.4 * GIB, 450e9, 50e9,
                       float8_peak_flops=PEAK_FLOAT8_TFLOPS["H200"] * 1e12, **GPU_RUNTIME),
    # A100 SXM4 80GB: 312 TFLOP/s bf16, 2.04 TB/s HBM2e, NVLink 3 600 GB/s total, 200 Gb/s NIC per GPU.
    "a100": DeviceSpec("A100 SXM 80GB", PEAK_BF16_TFLOPS["A100"] * 1e12, 2.039e12, 80.0 * GIB, 300e9, 25e9,
                       matmul_efficiency=0.75, attention_efficiency=0.50, **GPU_RUNTIME),
}
DEVICE_NAMES = (*DEVICES, "cpu")


def measure_cpu(world_size: int, collective_bandwidth: float | None = None) -> DeviceSpec:
    """This CPU as a "device": matmul rate and copy bandwidth measured here (one process, with the thread
    count each of ``world_size`` processes sharing the cores gets), gloo bandwidth as given (bytes/s,
    measured by ``scripts/benchmarks/dry_run_cpu_check.py``) or a nominal 1 GB/s. Efficiencies are 1: the rates are
    measured, not peaks. Memory capacity: the host's RAM."""
    threads = max(1, (os.cpu_count() or 1) // max(world_size, 1))
    matmul_n, copy_numel = 512, 1 << 22
    with torch_threads(threads):
        flops = matmul_flops(matmul_n) / matmul_seconds(matmul_n, 20)
        bandwidth = copy_bytes(copy_numel) / copy_seconds(copy_numel, 10)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = collective_bandwidth or 1e9
    return DeviceSpec(f"CPU ({threads} threads/process, measured)", flops, bandwidth, float(memory), link, link,
                      gpus_per_node=1 << 20, matmul_efficiency=1.0, attention_efficiency=1.0,
                      memory_efficiency=1.0, collective_efficiency=1.0, collective_latency=100e-6,
                      kernel_overhead=10e-6, intra_node_link="gloo")


def device_spec(name: str, world_size: int = 1, **overrides: float) -> DeviceSpec:
    spec = measure_cpu(world_size, overrides.pop("collective_bandwidth", None)) if name == "cpu" else DEVICES[name]
    return dataclasses.replace(spec, **overrides) if overrides else spec


def planned_device(dry_run: DryRun) -> DeviceSpec:
    """The device of a config's ``[dry_run]``: its table entry, or this CPU's measured rates."""
    measured = dry_run.device == "cpu" and dry_run.collective_bandwidth
    extra = {"collective_bandwidth": dry_run.collective_bandwidth} if measured else {}
    return device_spec(dry_run.device, dry_run.world_size, **extra)
