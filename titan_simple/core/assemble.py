"""The one assembly of a run: plan -> mesh -> model parts -> optimizer (-> LR schedule) -> step.

    run = build_run(plan, device)                  # or build_run(plan, device, mesh=mesh) when the mesh exists
    result = run.step(batches)

The trainer, the dry run's tracer, the search workers, the parity tests' reference, ``scripts/gpu_check.py`` and
``scripts/benchmarks/measure_memory.py`` all call it, so what they check or measure is what trains. It also installs the
step's features (``core/step_feature.StepFeature``): float8's per-step weight refresh when the plan gathers float8
weights, and what the caller adds (fault tolerance's cross-group average), so the step's body names no feature.
A compiled multi-rank run starts its compile-once session here, before anything compiles (``compile/once.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.config import JobConfig
from titan_simple.core.build import ModelParts, build_model_parts
from titan_simple.core.optim import lr_scheduler_from_config, optimizer_from_config
from titan_simple.core.plan import RunPlan
from titan_simple.core.step import TrainStep, build_train_step
from titan_simple.core.step_feature import StepFeature
from titan_simple.parallel.dims import ParallelDims, dp_rank_and_size
from titan_simple.parallel.float8_gather import refresh_float8_weights


@dataclass
class Run:
    """Everything one rank trains with. ``mesh`` is None on a single process; ``lr_scheduler`` None when the
    caller asked for a constant rate (the parity tests)."""

    plan: RunPlan
    mesh: DeviceMesh | None
    parts: ModelParts
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    step: TrainStep
    dp_rank: int
    dp_size: int

    @property
    def config(self) -> JobConfig:
        return self.plan.config

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims


class Float8WeightRefresh(StepFeature):
    """float8 all-gather: the weights changed at the last optimizer step, so each step starts by computing their
    float8 scales (one all-reduce of every weight's amax, ``parallel/float8_gather.py``)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules

    def before_forward(self) -> None:
        refresh_float8_weights(self.modules)


def _start_compile_once(mesh: DeviceMesh | None, device: torch.device) -> None:
    """One rank of each class compiles each graph, the others load it (``compile/once.py``; imported here, by
    compiled runs only: it imports Inductor). Every rank calls it, before the run's first compile; each run gets
    its own session (another run in the process may have another mesh, so other classes)."""
    from titan_simple.compile.inductor_private import inductor_cache_dir
    from titan_simple.compile.once import active_session, start_compile_once

    session = active_session()
    if session is None or not session.pinned:  # the precompile pins its own
        start_compile_once(inductor_cache_dir(), mesh, device)


def build_run(plan: RunPlan, device: torch.device, *, mesh: DeviceMesh | None = None, materialize: bool = True,
              lr_schedule: bool = True, keep_grad_buffers: bool = False,
              features: Sequence[StepFeature] = ()) -> Run:
    """Build this rank's run as ``plan`` says. Every rank of the world calls it (the mesh's sub-groups and the
    pipeline stages communicate). ``mesh``: reuse one already built from ``plan.dims`` (SimpleFSDP composes only
    slices of one root mesh); ``materialize=False`` leaves the model on the meta device (the dry run);
    ``keep_grad_buffers``: zero the gradients in place instead of freeing them (the memory measurements)."""
    if mesh is None:
        mesh = plan.dims.build_mesh(device.type)
    if plan.compile.enabled and plan.compile.once and materialize and dist.is_initialized():
        _start_compile_once(mesh, device)
    parts = build_model_parts(plan, mesh, device, materialize=materialize)
    optimizer = optimizer_from_config(plan.config, parts.as_module(), compiled=plan.compile.enabled)
    lr_scheduler = lr_scheduler_from_config(plan.config, optimizer, plan.stages) if lr_schedule else None
    installed: list[StepFeature] = []
    if plan.parallel.float8_all_gather:
        installed.append(Float8WeightRefresh(parts.modules))
    installed.extend(features)
    step = build_train_step(parts, plan, optimizer, lr_scheduler, features=installed,
                            keep_grad_buffers=keep_grad_buffers)
    dp_rank, dp_size = dp_rank_and_size(mesh, plan.dims)
    return Run(plan=plan, mesh=mesh, parts=parts, optimizer=optimizer, lr_scheduler=lr_scheduler, step=step,
               dp_rank=dp_rank, dp_size=dp_size)
