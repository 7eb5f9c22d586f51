"""Muon's Newton-Schulz work as the dry run prices it: per step, the slowest owner's orthogonalizations.

The trace of one rank holds its own Newton-Schulz matmuls, but of a model cut to a few blocks (``depth.py``
extrapolates everything else linearly in the blocks), and which matrices a rank owns is not linear in the blocks:
with fewer matrices than ranks, rank 0 owns the largest. So the orthogonalizations are priced here from the whole
stage's matrices, owned as ``parallel/matrix_owners.assign_owners`` assigns them over the ranks that hold the stage
(costliest first, to the least loaded), and the trace's optimizer-phase matmuls (which are Newton-Schulz's: AdamW has
none) are left out of its optimizer time. The all-to-alls stay the traced collectives: each rank sends its blocks of
every matrix, linear in the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_simple.core.muon import BLOCK_MATRIX, newton_schulz_flops
from titan_simple.core.plan import RunPlan
from titan_simple.dry_run.hardware import DeviceSpec
from titan_simple.models.llama3 import Transformer
from titan_simple.parallel.matrix_owners import assign_owners


@dataclass(frozen=True)
class NewtonSchulzCost:
    seconds: float  # the slowest owner's orthogonalizations per step
    matrices: int  # of the pipeline rank with the most layers
    owners: int  # ranks that share them
    imbalance: float  # the slowest owner's FLOPs over the mean


def newton_schulz_cost(run: RunPlan, spec: DeviceSpec) -> NewtonSchulzCost | None:
    """None without Muon. The block matrices of the pipeline rank holding the most layers (the whole model without
    pipeline parallel), owned over its ranks (every mesh dim but pp), at the device's matmul rate (float32 at half
    bf16's)."""
    if run.muon is None:
        return None
    with torch.device("meta"):
        model = Transformer(run.model_args)
    shapes = {}
    for name, param in model.named_parameters():
        if BLOCK_MATRIX.search(name) and not any(p in name for p in run.muon.excluded):
            shapes.setdefault(int(name.split(".")[1]), []).append(tuple(param.shape))
    plan = run.pipeline
    layers = len(shapes) if plan is None else max(sum(len(plan.stage_layers[s]) for s in plan.stages_of_rank(r))
                                                  for r in range(plan.pp))
    stage = [shape for layer in sorted(shapes)[:layers] for shape in shapes[layer]]
    costs = [newton_schulz_flops(shape, run.muon.ns_steps) for shape in stage]
    ranks = run.dims.world_size // run.dims.pp
    owners = assign_owners(costs, tuple(range(ranks)))
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(ranks)]
    rate = spec.peak_flops * spec.matmul_efficiency * (1.0 if run.muon.ns_dtype == "bfloat16" else 0.5)
    mean = sum(loads) / ranks
    return NewtonSchulzCost(max(loads) / rate, len(stage), ranks, max(loads) / mean if mean else 1.0)
