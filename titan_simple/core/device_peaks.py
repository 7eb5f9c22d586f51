"""Vendor peak FLOP/s of the GPUs we know, bf16 and float8: what MFU is taken against (the trainer's metrics) and
what the dry run plans with (``dry_run/hardware.py``). Every GPU peak the project uses is here."""

from __future__ import annotations

import torch

# Dense (no 2:4 sparsity) BF16 tensor-core peak, TFLOP/s, from the vendor datasheets.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}

# Dense float8 (e4m3) tensor-core peak, TFLOP/s, where the GPU has float8 matmuls (twice bf16's on Hopper).
PEAK_FLOAT8_TFLOPS: dict[str, float] = {"H100 SXM": 1979.0, "H200": 1979.0, "B200": 4500.0}

# (substrings that must all occur in torch.cuda.get_device_name(), table key), most specific first:
# "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" must not fall through to the SXM entry ("NVIDIA H100 80GB HBM3").
_DEVICE_NAME_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("H100", "PCIe"), "H100 PCIe"),
    (("H100", "NVL"), "H100 NVL"),
    (("H100",), "H100 SXM"),
    (("H200",), "H200"),
    (("A100",), "A100"),
    (("L40S",), "L40S"),
    (("B200",), "B200"),
)


def peak_tflops_for_device_name(device_name: str) -> float | None:
    """Dense BF16 peak TFLOP/s for a CUDA device name, or None when the device is not in the table."""
    for substrings, key in _DEVICE_NAME_RULES:
        if all(s in device_name for s in substrings):
            return PEAK_BF16_TFLOPS[key]
    return None


def peak_flops_per_second(device: torch.device) -> float | None:
    """Peak FLOP/s of ``device`` for MFU; None on CPU or an unknown GPU, so MFU is left out, not guessed."""
    if device.type != "cuda":
        return None
    tflops = peak_tflops_for_device_name(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12
