"""The plan -> the model parts this rank trains: the one build everything calls.

    plan = resolve_plan(config, world_size, device.type)   # core/plan.py: every decision, no communication
    mesh = plan.dims.build_mesh(device.type)
    parts = build_model_parts(plan, mesh, device)           # parts.modules: [model] or this rank's stages
                                                            # (core/assemble.build_run calls it)

The model is built on the meta device and goes through the recipe (``parallelize.parallelize_llama``: tensor
parallel -> activation checkpointing -> SimpleFSDP / FSDP2 -> compile) as ``plan.parallel`` says (a
``whole_with_loss`` compile, of the model and its loss as one graph, is done here after the recipe); with pipeline
parallel it is split into stages first and each stage gets the recipe (``pipeline.build_pipeline``). Then every
part is materialized and initialized with layout-invariant random numbers (``sharded_init``): the same seed
gives the same weights on every layout. ``materialize=False`` leaves the parts on the meta device (the dry run
traces them there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.core.loss import ModelWithLoss
from titan_simple.core.plan import RunPlan
from titan_simple.models.float8 import convert_to_float8
from titan_simple.models.llama3 import ModelArgs, Transformer, count_parameters, flops_per_token
from titan_simple.parallel.context_parallel import ContextParallel, context_parallel_mesh
from titan_simple.parallel.fsdp_gather import StepGather
from titan_simple.parallel.parallelize import parallelize_llama
from titan_simple.parallel.pipeline import PipelineRun, build_pipeline
from titan_simple.parallel.sharded_init import materialize_and_init

if TYPE_CHECKING:  # an eager run never imports the compiler
    from titan_simple.compile.comm_plan import CommPlanRecorder


@dataclass
class ModelParts:
    """What one rank trains. ``modules``: the parallelized model, or this rank's pipeline stages (each a model
    that keeps the whole model's parameter names); ``pipeline``: the schedule that runs the stages, or None."""

    model_args: ModelArgs
    modules: list[nn.Module]
    pipeline: PipelineRun | None
    device: torch.device
    num_params: int  # of the whole model, not this rank's share
    flops_per_token: float  # model FLOPs of training (6 N + attention), for TFLOP/s and MFU
    # Set when SimpleFSDP gathers once per step ([parallelism] fsdp_gather): the step calls gather() before its
    # first microbatch and reduce() after its last.
    once_per_step_gather: StepGather | None = None
    # The model and its loss as one module, compiled as one graph when the plan says so
    # (``plan.loss.compiled_with_model``); the step runs it instead of the model.
    model_with_loss: ModelWithLoss | None = None
    # Context parallel: this rank's share of each sequence, and the loss summed over the cp group.
    context_parallel: ContextParallel | None = None
    # What compiling the parts recorded: the collectives of each compiled graph, once per recorder (pipeline
    # stages compiled regionally share one). The run keeps them here; the compiled modules hold none.
    comm_plan_recorders: list[CommPlanRecorder] = field(default_factory=list)

    @property
    def model(self) -> nn.Module | None:
        """The whole model when there is no pipeline, else None."""
        return self.modules[0] if self.pipeline is None else None

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]

    def as_module(self) -> nn.Module:
        """All parts as one module (for the optimizer and checkpoint helpers that take a module)."""
        return self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)


def build_model_parts(plan: RunPlan, mesh: DeviceMesh | None, device: torch.device, *,
                      materialize: bool = True) -> ModelParts:
    """Build, parallelize and (unless ``materialize=False``) initialize this rank's parts of the model. Every
    rank of the world calls it (building the mesh's sub-groups and the pipeline stages communicates)."""
    training = plan.config.training
    with torch.device("meta"):
        model = Transformer(plan.model_args, attention=plan.attention.kernel)
    if plan.float8 is not None:  # before tensor parallel, AC and SimpleFSDP: they see plain linears' weights
        convert_to_float8(model, plan.float8.recipe, list(plan.float8.filter_fqns), emulate=plan.float8.emulate,
                          targets=plan.float8.targets)
    num_params = count_parameters(model)
    flops = flops_per_token(plan.model_args, count_parameters(model, exclude_embedding=True), training.seq_len)
    if plan.pipeline is not None:
        # This rank's stages, each split off, parallelized and initialized like a whole model, and the schedule
        # that runs them with the training loss on the last stage.
        pipeline = build_pipeline(model, mesh, plan.pipeline, plan.parallel, device, seed=training.seed,
                                  loss_fn=plan.loss.scaled, materialize=materialize)
        modules, recorders = pipeline.model_parts, pipeline.comm_plan_recorders
    else:
        pipeline = None
        recorders = [parallelize_llama(model, mesh, plan.parallel)]
        if materialize:
            materialize_and_init(model, device, training.seed)  # the same values on every layout
        modules = [model]
    model_with_loss, loss_recorder = _model_with_loss(plan, modules)
    # Compiled forwards read the held weights as graph inputs: they must be gathered before the forward starts.
    once_per_step_gather = (StepGather(modules, lazy=not plan.compile.enabled) if plan.fsdp_gather == "once_per_step"
                   else None)
    return ModelParts(
        model_args=plan.model_args, modules=modules, pipeline=pipeline,
        device=device if materialize else torch.device("meta"), num_params=num_params, flops_per_token=flops,
        once_per_step_gather=once_per_step_gather, model_with_loss=model_with_loss,
        context_parallel=ContextParallel(context_parallel_mesh(mesh)) if plan.dims.cp > 1 else None,
        comm_plan_recorders=_distinct([*recorders, loss_recorder]),
    )


def _model_with_loss(plan: RunPlan, modules: list[nn.Module]
                     ) -> tuple[ModelWithLoss | None, CommPlanRecorder | None]:
    """The model and the loss as one module when the plan compiles them together (``whole_with_loss``), and its
    compile's comm plan recorder; it is compiled here, where the recipe (``parallelize_llama``) compiles every
    other mode, so that the step runs what it is given and compiles nothing. The dry run's plan has compile off:
    it traces the module eagerly."""
    if not plan.loss.compiled_with_model:
        return None, None
    model_with_loss = ModelWithLoss(modules[0], plan.autocast, plan.loss)
    recorder = plan.compile.compile_whole(model_with_loss, plan_root="model") if plan.compile.enabled else None
    return model_with_loss, recorder


def _distinct(recorders: list[object | None]) -> list[CommPlanRecorder]:
    """Each recorder once, in order (a regional compile's pipeline stages share one); no None."""
    return list({id(r): r for r in recorders if r is not None}.values())
