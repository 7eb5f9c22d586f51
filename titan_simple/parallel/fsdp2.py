"""PyTorch's FSDP2 (``fully_shard``), kept as the baseline SimpleFSDP is measured against."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_simple.errors import ConfigError


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mode: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> nn.Module:
    """Shard each transformer block as its own unit, then the root (embedding, final norm, output)."""
    if mode == "replicate":
        raise ConfigError(
            "[parallelism] fsdp_implementation = 'fsdp2' shards parameters; for pure replication "
            "(data_parallel_shard_degree = 1) use fsdp_implementation = 'simple'."
        )
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters are used last in forward and first in backward: keeping them is free.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def gradient_averaging_factor(model: nn.Module, dp_degree: int) -> int:
    """FSDP2 averages gradients over the data-parallel ranks; our loss is already divided by the global
    token count, so the trainer multiplies the loss by this factor to get summed gradients back.
    (``set_gradient_divide_factor(1.0)`` would say it directly, but needs PREMUL_SUM, which gloo lacks.)"""
    return dp_degree if isinstance(model, FSDPModule) else 1
