"""Gradient clipping to one global norm, for every layout: plain tensors, DTensors on any mesh (data / tensor
parallel shards), and pipeline stages spread over the pp ranks."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, foreach: bool | None = None
) -> tuple[torch.Tensor | None, list[list[torch.Tensor]]]:
    """The norm of the gradients of ``parameters`` (``None`` if none has one), and the parameters grouped by
    their gradient's (mesh, placements), as ``clip_grads_with_norm_`` wants them.

    Within a group torch's ``get_total_norm`` gives a DTensor whose ``full_tensor()`` reduces the shards'
    partial norms; the groups' norms are then combined locally. Communicates over the meshes of sharded
    gradients, so every rank of them must call it."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else None
    return total, list(groups.values())


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients to a global ``max_norm``; return the global norm (a plain tensor, the same on every rank).

    With ``pp_group`` each rank's norm covers its own stages; the pp ranks then combine theirs (a sum of
    ``norm ** p``, a max for the inf-norm). Every rank must call it (it communicates)."""
    parameters = list(parameters)
    local, groups = grad_norm(parameters, norm_type, foreach)
    if pp_group is None:
        if local is None:
            return torch.tensor(0.0)
        total = local
    else:
        if local is None:  # this stage has no gradients; it still takes part in the pp reduction
            local = torch.zeros((), device=parameters[0].device if parameters else None)
        if math.isinf(norm_type):
            total = local.clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = local**norm_type
            dist.all_reduce(total, group=pp_group)
            total = total ** (1.0 / norm_type)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
