"""Config + mesh + device -> the model parts this rank trains: the one build everything calls.

    dims = ParallelDims.from_config(config, world_size)
    mesh = dims.build_mesh(device.type)
    parts = build_model_parts(config, dims, mesh, device)   # parts.modules: [model] or this rank's stages

The model is built on the meta device and goes through the recipe (``parallelize.parallelize_llama``: tensor
parallel -> activation checkpointing -> SimpleFSDP / FSDP2 -> compile); with pipeline parallel it is split into
stages first and each stage gets the recipe (``pipeline.build_pipeline``). Then every part is materialized and
initialized with layout-invariant random numbers (``sharded_init``): the same seed gives the same weights on
every layout. ``materialize=False`` leaves the parts on the meta device (the dry run traces them there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import LLAMA3_FLAVORS, ModelArgs, build_model, count_parameters, flops_per_token
from titan_simple.parallel.dims import ParallelDims, validate_parallelism
from titan_simple.parallel.parallelize import (
    compile_per_block,
    compile_whole_model,
    gather_mode,
    parallelize_llama,
    param_dtype_for,
    uses_loss_parallel,
)
from titan_simple.parallel.pipeline import PipelinePlan, PipelineRun, build_pipeline, plan_pipeline
from titan_simple.parallel.sharded_init import materialize_and_init
from titan_simple.parallel.step_gather import StepGather
from titan_simple.train.batching import accumulation_steps


@dataclass
class ModelParts:
    """What one rank trains. ``modules``: the parallelized model, or this rank's pipeline stages (each a model
    that keeps the whole model's parameter names); ``pipeline``: the schedule that runs the stages, or None."""

    model_args: ModelArgs
    modules: list[nn.Module]
    pipeline: PipelineRun | None
    device: torch.device
    param_dtype: torch.dtype  # what the forward computes in (bf16 on GPUs by default)
    loss_parallel: bool  # the output is vocab-sharded: loss and backward run under loss_parallel_context
    num_params: int  # of the whole model, not this rank's share
    flops_per_token: float  # model FLOPs of training (6 N + attention), for TFLOP/s and MFU
    # Set when the model compiles as one graph: compiles (in place) a module that wraps the model as ``.model``,
    # so the training step compiles the model and its loss together.
    compile_with_loss: Callable[[nn.Module], None] | None = None
    # Set when SimpleFSDP gathers once per step ([parallelism] fsdp_gather): the step calls gather() before its
    # first microbatch and reduce() after its last.
    step_gather: StepGather | None = None

    @property
    def model(self) -> nn.Module | None:
        """The whole model when there is no pipeline, else None."""
        return self.modules[0] if self.pipeline is None else None

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]

    def as_module(self) -> nn.Module:
        """All parts as one module (for the optimizer and checkpoint helpers that take a module)."""
        return self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)


def flavor_args(config: JobConfig) -> ModelArgs:
    """The ``[model] flavor``'s arguments, or the one-line error naming the known flavors."""
    if config.model.flavor not in LLAMA3_FLAVORS:
        build_model(config.model.flavor)  # raises the unknown-flavor ConfigError
    return LLAMA3_FLAVORS[config.model.flavor]


def check_layout(config: JobConfig, dims: ParallelDims) -> int:
    """Every check of the layout that needs no communication (call it before creating a process group): the
    flavor, the degrees against the model, the pipeline plan, the global batch. Returns the gradient
    accumulation steps."""
    validate_parallelism(dims, flavor_args(config), config)
    pipeline_plan(config, dims)
    gather_mode(config, dims)
    training = config.training
    return accumulation_steps(training.global_batch_size, training.local_batch_size, dims.dp)


def check_vocabulary(config: JobConfig, tokenizer_vocab_size: int) -> None:
    """The tokenizer's ids must fit the model's embedding."""
    args = flavor_args(config)
    if tokenizer_vocab_size > args.vocab_size:
        raise ConfigError(
            f"[model] tokenizer_path {config.model.tokenizer_path} has {tokenizer_vocab_size} tokens but flavor "
            f"'{config.model.flavor}' has a vocabulary of {args.vocab_size}; use a matching tokenizer or flavor."
        )


def pipeline_plan(config: JobConfig, dims: ParallelDims) -> PipelinePlan | None:
    """The pipeline's stages and microbatches, checked against the model (no communication); None without pp."""
    if dims.pp == 1:
        return None
    return plan_pipeline(config, LLAMA3_FLAVORS[config.model.flavor].n_layers, dims.pp)


def compiles_loss_with_model(config: JobConfig, dims: ParallelDims) -> bool:
    """Whether the training step compiles the loss into the model's graph: a whole-model compile without
    pipeline parallel (the schedule calls the loss) or tensor parallel (the loss runs on DTensors under
    loss_parallel)."""
    return config.compile.enable and dims.pp == 1 and dims.tp == 1 and not compile_per_block(config, dims)


def build_model_parts(config: JobConfig, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device, *,
                      materialize: bool = True) -> ModelParts:
    """Build, parallelize and (unless ``materialize=False``) initialize this rank's parts of the model. Every
    rank of the world calls it (building the mesh's sub-groups and the pipeline stages communicates)."""
    training = config.training
    model = build_model(config.model.flavor, max_seq_len=training.seq_len, device="meta")
    args = model.args
    num_params = count_parameters(model)
    flops = flops_per_token(args, count_parameters(model, exclude_embedding=True), training.seq_len)
    plan = pipeline_plan(config, dims)
    loss_parallel = uses_loss_parallel(dims, config)
    compile_with_loss = (partial(compile_whole_model, config=config, plan_root="model")
                         if compiles_loss_with_model(config, dims) else None)
    if plan is not None:
        # This rank's stages, each split off, parallelized and initialized like a whole model, and the schedule
        # that runs them.
        pipeline = build_pipeline(model, dims, mesh, config, device, plan, materialize=materialize)
        modules = pipeline.model_parts
    else:
        pipeline = None
        model = parallelize_llama(model, dims, mesh, config, device, compile_whole=compile_with_loss is None)
        if materialize:
            materialize_and_init(model, device, training.seed)  # the same values on every layout
        modules = [model]
    step_gather = StepGather(modules) if gather_mode(config, dims) == "once_per_step" else None
    return ModelParts(
        model_args=args, modules=modules, pipeline=pipeline, device=device if materialize else torch.device("meta"),
        param_dtype=param_dtype_for(config, device), loss_parallel=loss_parallel,
        num_params=num_params, flops_per_token=flops, compile_with_loss=compile_with_loss, step_gather=step_gather,
    )
