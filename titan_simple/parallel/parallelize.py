"""The recipe: how a Llama 3 model becomes a parallel one, in the order it happens."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.config import JobConfig
from titan_simple.parallel.dims import ParallelDims, dp_mesh
from titan_simple.parallel.fsdp2 import apply_fsdp2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype_for(config: JobConfig, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs; fp32 on CPU, where bf16 matmuls run about 2x slower (measured)."""
    name = config.training.mixed_precision_param
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def parallelize_llama(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, config: JobConfig, device: torch.device
) -> nn.Module:
    """Data parallel over the (dp_replicate, dp_shard) mesh."""
    if dims.dp_enabled:
        apply_fsdp2(
            model,
            dp_mesh(mesh, dims),
            mode=dims.data_parallel_mode,
            param_dtype=param_dtype_for(config, device),
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=True,
        )
    return model
