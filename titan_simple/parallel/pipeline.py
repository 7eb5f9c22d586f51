"""Pipeline parallel: split the model into stages by layers, place them on the pp ranks, run a schedule.

    plan = plan_pipeline(config, n_layers, pp)            # pure: checks the config (called by core/plan.py)
    run = build_pipeline(model, mesh, plan, parallel_plan, device, seed=0, loss_fn=loss_fn)
    loss_sum = run.step(inputs, labels, loss_scale)       # forward + backward of one local batch

**Stages.** A stage is a deep copy of the (meta) model in which the layers it does not own are deleted and
``tok_embeddings`` (all but the first stage) / ``norm`` + ``output`` (all but the last) are ``None``: the
surviving parameters keep their whole-model names (``layers.3.attention.wq.weight``), so checkpoints and
comparisons line up across layouts. Stage boundaries come from ``pipeline_parallel_split_points``
(``["layers.3"]``: layer 3 starts a stage), ``pipeline_parallel_layers_per_stage``, or by default as many stages
as the schedule runs per rank (1 for GPipe / 1F1B, 2 for the looped / interleaved / zero-bubble ones) with the
layers spread evenly, earlier stages taking the remainder.

**Placement.** Stage ``s`` lives on pp rank ``s % pp`` ("loop"), except under ZBVZeroBubble where rank ``r``
holds stages ``r`` and ``2 pp - 1 - r`` ("V": the first and the last stage share rank 0).

**Each stage is its own model**, parallelized with the same recipe as a whole model (``parallelize_llama``:
activation checkpointing -> SimpleFSDP / FSDP2 on the dp mesh -> compile), then materialized and initialized.
A stage compiles whole (its collectives in one graph), except under the zero-bubble schedules
(InterleavedZeroBubble, ZBVZeroBubble): they split each backward into an input part and a weight part by
walking the autograd graph, and through a whole compiled stage that gave wrong weight gradients (some 0; torch
2.13 refuses only a stage that is an ``OptimizedModule``, not one compiled in place). There each block
compiles on its own (``CompilePlan.mode = "per_block"``, decided in ``core/plan.py``): a compiled block is
one autograd node, so its backward runs in the input phase and again in the weight phase (correct; the weight
gradients are computed twice), and it must be compiled without donated buffers, which forbid a second
backward.

**Init.** Each stage runs the model's own ``init_weights`` (the absent modules are skipped) under
``layout_invariant_init(stage, seed)``, which seeds every parameter's draws from ``(seed, parameter name)``:
a stage gets exactly the values the whole model gets, whichever modules come before it.

**Loss.** The schedule splits the local batch into ``local_batch_size / microbatch_size`` microbatches along
dim 0, calls the loss function per microbatch on the last stage and backpropagates each; the gradients add
up. The loss function is the training loss (``core/loss.py``), given to ``build_pipeline``: ``summed
cross-entropy x loss_scale`` with ``loss_scale = 1 / global tokens`` (the
trainer's scaling), and the schedule's own 1/n_microbatches scaling is off (``scale_grads=False``): the sum over
microbatches and dp ranks is then exactly the single-process gradient.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.models.attention import AttentionInputs
from titan_simple.parallel.dims import tensor_parallel_mesh
from titan_simple.parallel.parallelize import ParallelPlan, parallelize_llama
from titan_simple.parallel.sharded_init import materialize_and_init
from titan_simple.parallel.torch_private import no_donated_buffers

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
# Schedules that run one stage per pp rank (the others run several).
SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
# Schedules that split each backward into input and weight gradients by walking the autograd graph.
ZERO_BUBBLE_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
V_SCHEDULES = frozenset({"ZBVZeroBubble"})
# (output, labels, loss_scale) -> the scaled loss of one microbatch (core/loss.py).
LossFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage owns, where each stage runs, and how the local batch is cut."""

    schedule: str
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # global layer indices of each stage, in order
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs ``stage``: loop (``s % pp``) or, for V schedules, ``r`` and ``2 pp - 1 - r``."""
        if self.schedule in V_SCHEDULES:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank]


def _split_evenly(n_layers: int, num_stages: int) -> list[int]:
    """Stage sizes: as even as possible, the earlier stages taking one extra layer each."""
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def _parse_split_point(point: str, n_layers: int) -> int:
    prefix, _, index = point.partition(".")
    if prefix != "layers" or not index.isdigit() or not 0 < int(index) < n_layers:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_split_points: {point!r} is not a layer that can start a stage; "
            f"use 'layers.N' with 1 <= N <= {n_layers - 1} (the model has {n_layers} layers)."
        )
    return int(index)


def _stage_sizes(parallelism, n_layers: int, pp: int) -> tuple[list[int], str]:
    """The layers of each stage, and how the config made them (for the errors)."""
    schedule = parallelism.pipeline_parallel_schedule
    per_rank_needed = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    if parallelism.pipeline_parallel_split_points and parallelism.pipeline_parallel_layers_per_stage is not None:
        raise ConfigError(
            "[parallelism] pipeline_parallel_split_points and pipeline_parallel_layers_per_stage both set; "
            "give one of them (or neither for an even split)."
        )
    if parallelism.pipeline_parallel_split_points:
        starts = [_parse_split_point(point, n_layers) for point in parallelism.pipeline_parallel_split_points]
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ConfigError(
                f"[parallelism] pipeline_parallel_split_points = {parallelism.pipeline_parallel_split_points} must "
                f"name strictly increasing layers, e.g. ['layers.2', 'layers.4']."
            )
        bounds = [0, *starts, n_layers]
        sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        how = f"pipeline_parallel_split_points = {parallelism.pipeline_parallel_split_points} make"
    elif parallelism.pipeline_parallel_layers_per_stage is not None:
        per_stage = parallelism.pipeline_parallel_layers_per_stage
        num_stages = math.ceil(n_layers / per_stage)
        sizes = [per_stage] * (num_stages - 1) + [n_layers - per_stage * (num_stages - 1)]
        how = f"pipeline_parallel_layers_per_stage = {per_stage} makes"
    else:
        num_stages = per_rank_needed * pp
        if num_stages > n_layers:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule = {schedule!r} with pipeline_parallel_degree = {pp} "
                f"needs {num_stages} stages but the model has only {n_layers} layers; lower the degree or "
                f"choose a single-stage schedule (GPipe, 1F1B)."
            )
        sizes = _split_evenly(n_layers, num_stages)
        how = "the default split makes"
    return sizes, how


def _check_stages_per_rank(schedule: str, num_stages: int, pp: int, how: str) -> None:
    """Every pp rank holds the same number of stages, as many as the schedule runs."""
    if num_stages % pp:
        raise ConfigError(
            f"[parallelism] {how} {num_stages} stages, not a multiple of pipeline_parallel_degree = {pp}; "
            f"every pp rank must hold the same number of stages."
        )
    per_rank = num_stages // pp
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ConfigError(
            f"[parallelism] {how} {per_rank} stages per pp rank but pipeline_parallel_schedule = {schedule!r} "
            f"runs 1; use Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble, or {pp} stages."
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and per_rank < 2:
        raise ConfigError(
            f"[parallelism] {how} 1 stage per pp rank but pipeline_parallel_schedule = {schedule!r} runs "
            f"several; use GPipe or 1F1B, or {2 * pp} stages."
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ConfigError(
            f"[parallelism] {how} {per_rank} stages per pp rank but ZBVZeroBubble runs exactly 2; "
            f"use {2 * pp} stages."
        )


def _check_microbatches(schedule: str, n_microbatches: int, num_stages: int, pp: int) -> None:
    """Enough microbatches for 1F1B; whole rounds of pp microbatches for the interleaved schedules."""
    if schedule == "1F1B" and n_microbatches < num_stages:
        raise ConfigError(
            f"[parallelism] 1F1B needs at least as many microbatches as stages ({num_stages}), but "
            f"local_batch_size / pipeline_parallel_microbatch_size = {n_microbatches}; raise local_batch_size "
            f"or lower pipeline_parallel_microbatch_size."
        )
    rounds = max(1, n_microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n_microbatches % rounds:
        raise ConfigError(
            f"[parallelism] {schedule} runs microbatches in rounds of pipeline_parallel_degree = {pp}, but "
            f"local_batch_size / pipeline_parallel_microbatch_size = {n_microbatches}; use a multiple of {pp}."
        )


def plan_pipeline(config: JobConfig, n_layers: int, pp: int) -> PipelinePlan:
    """Check the pipeline settings against the model and the pp degree (no communication) and plan the stages."""
    parallelism, training = config.parallelism, config.training
    schedule = parallelism.pipeline_parallel_schedule
    sizes, how = _stage_sizes(parallelism, n_layers, pp)
    num_stages = len(sizes)
    _check_stages_per_rank(schedule, num_stages, pp, how)
    n_microbatches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    _check_microbatches(schedule, n_microbatches, num_stages, pp)
    bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
    stage_layers = tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages))
    return PipelinePlan(schedule=schedule, pp=pp, stage_layers=stage_layers, n_microbatches=n_microbatches)


# ---------------------------------------------------------------------------------------------- split


def split_stage(model: nn.Module, plan: PipelinePlan, stage: int) -> nn.Module:
    """A deep copy of ``model`` that keeps only what ``stage`` owns; parameter names stay global."""
    part = copy.deepcopy(model)
    owned = {str(i) for i in plan.stage_layers[stage]}
    for name in list(part.layers.keys()):
        if name not in owned:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != plan.num_stages - 1:
        part.norm = None
        part.output = None
    return part


# ---------------------------------------------------------------------------------------------- run


class PipelineRun:
    """This rank's stages and the schedule that drives them.

    ``model_parts``: the local stage modules (the optimizer and gradient clipping cover all of them);
    ``comm_plan_recorders``: what compiling them recorded (``parallelize_llama``'s, one per compiled stage).
    ``step(inputs, labels, loss_scale)``: forward + backward of one local batch through the whole pipeline;
    every pp rank calls it with the same batch. Returns the summed (unscaled) loss on the rank that holds the
    last stage, ``None`` elsewhere.
    """

    def __init__(self, plan: PipelinePlan, model_parts: list[nn.Module], stages: list[PipelineStage],
                 pp_group: dist.ProcessGroup, loss_fn: LossFn, comm_plan_recorders: Sequence[object] = ()):
        self.plan = plan
        self.model_parts = model_parts
        self.comm_plan_recorders = list(comm_plan_recorders)
        self.stages = stages
        self.pp_group = pp_group
        self.has_first_stage = any(stage.is_first for stage in stages)
        self.has_last_stage = any(stage.is_last for stage in stages)
        self.loss_fn = loss_fn
        self._loss_scale = 1.0
        schedule_class = get_schedule_class(plan.schedule)
        # scale_grads=False: the loss is already divided by the global token count, the sum is the gradient.
        self.schedule = schedule_class(
            stages[0] if issubclass(schedule_class, PipelineScheduleSingle) else stages,
            n_microbatches=plan.n_microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )

    def _compile_settings(self) -> contextlib.AbstractContextManager:
        """The zero-bubble schedules run a compiled region's backward twice (input gradients, then weight
        gradients, ``retain_graph=True``); a backward compiled with donated buffers refuses that. Compilation
        happens at the first call, inside ``step``."""
        if self.plan.schedule in ZERO_BUBBLE_SCHEDULES:
            return no_donated_buffers()
        return contextlib.nullcontext()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels, self._loss_scale)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float,
             attention_inputs: AttentionInputs | None = None) -> torch.Tensor | None:
        """``attention_inputs`` (block-causal attention's document ids, context parallel's positions) go to every
        stage, each tensor split into microbatches along the batch dim like the inputs (``AttentionInputs`` is a
        pytree node)."""
        self._loss_scale = loss_scale
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        with self._compile_settings():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False,
                               **_model_kwargs(attention_inputs))
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / loss_scale

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 attention_inputs: AttentionInputs | None = None) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval``): the summed loss of one local batch on the rank that holds
        the last stage, ``None`` elsewhere. Every pp rank calls it with the same batch, under ``no_grad``.

        On every switch between ``step`` and ``eval`` the schedule infers the stages' send/receive shapes again
        (torch 2.13: a metadata forward through each stage and an exchange between stages), so validating often
        costs a little more than its batches."""
        self._loss_scale = 1.0
        args = (inputs,) if self.has_first_stage else ()
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        with self._compile_settings():
            self.schedule.eval(*args, target=labels if self.has_last_stage else None, losses=losses,
                               return_outputs=False, **_model_kwargs(attention_inputs))
        return None if losses is None else torch.stack(losses).sum()

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the pp group. With the loss, which only the last stage's rank holds (the
        others pass 0): every pp rank then holds its dp slice's loss, like ranks that share a batch do."""
        total = value.detach().clone()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def describe(self) -> str:
        plan = self.plan
        layers = ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in plan.stage_layers)
        local = ", ".join(str(stage.stage_index) for stage in self.stages)
        return (f"pipeline {plan.schedule}: {plan.num_stages} stages (layers {layers}), this rank runs stage(s) "
                f"{local}; {plan.n_microbatches} microbatches per local batch")


def _model_kwargs(attention_inputs: AttentionInputs | None) -> dict[str, AttentionInputs]:
    """The schedule's keyword inputs for every stage: none for causal attention (the call it always made)."""
    return {} if attention_inputs is None else {"attention_inputs": attention_inputs}


def _named_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    return tensor_parallel_mesh(mesh) if tuple(names) == ("tp",) else mesh[names]


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: PipelinePlan,
    parallel: ParallelPlan,
    device: torch.device,
    *,
    seed: int,
    loss_fn: LossFn,
    materialize: bool = True,
) -> PipelineRun:
    """Split the meta ``model`` into this rank's stages, parallelize (``parallel``), materialize and initialize
    (``seed``) each, and wrap them in the planned schedule, which calls ``loss_fn(output, labels, loss_scale)``
    per microbatch on the last stage. Every rank of the world calls it."""
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    parts, stages, recorders = [], [], []
    for stage_index in plan.stages_of_rank(pp_rank):
        part = split_stage(model, plan, stage_index)
        recorders.append(parallelize_llama(part, mesh, parallel))
        if materialize:
            materialize_and_init(part, device, seed)
        parts.append(part)
        # get_mesh: the stage's first step infers the shapes of what it sends and receives; DTensor
        # activations (tensor parallel) name their mesh, which the receiving stage looks up in ours: the very
        # mesh object its parameters use (dims.tensor_parallel_mesh says why).
        stages.append(PipelineStage(part, stage_index, plan.num_stages, device, group=pp_mesh.get_group(),
                                    get_mesh=lambda names, _layout: _named_mesh(mesh, names)))
    return PipelineRun(plan, parts, stages, pp_mesh.get_group(), loss_fn,
                       comm_plan_recorders=[r for r in recorders if r is not None])
