"""The recipe: how a Llama 3 model becomes a parallel one, in the order it happens.

    tensor parallel -> activation checkpointing -> data parallel (SimpleFSDP or FSDP2) -> torch.compile

Tensor parallel goes first, on the meta model: the data-parallel wrappers then shard its DTensor parameters
further over the dp mesh (the joint (dp, tp) mesh). Pipeline parallel slots in around these steps.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.config import JobConfig
from titan_simple.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_simple.parallel.compile import compile_model
from titan_simple.parallel.dims import ParallelDims, dp_mesh
from titan_simple.parallel.fsdp2 import apply_fsdp2
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, data_parallel
from titan_simple.parallel.tensor_parallel import apply_tensor_parallel, keep_gradient_layouts

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype_for(config: JobConfig, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs; fp32 on CPU, where bf16 matmuls run about 2x slower (measured)."""
    name = config.training.mixed_precision_param
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def reshard_after_forward(config: JobConfig, dims: ParallelDims) -> bool:
    choice = config.parallelism.fsdp_reshard_after_forward
    if choice == "default":
        # Under PP, resharding would add a second all-gather per microbatch (in its backward) to the one
        # every microbatch forward already does: SimpleFSDP gathers inside each forward, so it gathers once
        # per microbatch, not once per step as FSDP2 does (see docs/dry_run.md: 16x FSDP2's all-gather
        # traffic for the 405B config). Keeping the gathered weights for backward halves that.
        return dims.pp == 1
    return choice == "always"


def uses_loss_parallel(dims: ParallelDims, config: JobConfig) -> bool:
    """Whether the model returns vocab-sharded logits, so the loss (and its backward) must run under
    ``tensor_parallel.loss_parallel_context(True)``."""
    return dims.tp > 1 and not config.parallelism.disable_loss_parallel


# Pipeline schedules that split each backward into input and weight gradients by walking the autograd graph.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


def compile_per_block(config: JobConfig, dims: ParallelDims) -> bool:
    """Compile each transformer block rather than the whole model (or pipeline stage): with FSDP2, whose hooks
    break a whole-model graph (fullgraph fails in torch 2.13), and under the zero-bubble pipeline schedules,
    whose split backward gives wrong weight gradients through a whole compiled stage (measured: some are 0),
    and for tensor parallel inside a pipeline stage, where AOTAutograd's partitioner fails on the last stage
    (input activations that need gradients, vocab-sharded DTensor logits out: "Node tangents_2 was invalid,
    but is output", torch 2.13)."""
    if config.parallelism.fsdp_implementation != "simple":
        return True
    if dims.pp > 1 and dims.tp > 1:
        return True
    return dims.pp > 1 and config.parallelism.pipeline_parallel_schedule in ZERO_BUBBLE_SCHEDULES


def parallelize_llama(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, config: JobConfig, device: torch.device
) -> nn.Module:
    """Apply tensor parallel, activation checkpointing, data parallel and compilation to ``model`` (on the
    meta device)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], loss_parallel=uses_loss_parallel(dims, config))
        if not dims.dp_enabled:
            keep_gradient_layouts(model)  # the data-parallel wrappers would otherwise do it

    ac = config.activation_checkpoint
    if ac.mode != "none":
        apply_activation_checkpointing(model.layers, ac.mode, ac.selective_ac_option)

    simple = config.parallelism.fsdp_implementation == "simple"
    compile_config = config.compile
    per_block = compile_per_block(config, dims)
    if compile_config.enable and per_block:
        if compile_config.bucketing != "none" or compile_config.reorder:
            logger.warning(
                "[compile] bucketing = %r, reorder = %s ignored: this layout compiles each transformer block on "
                "its own (FSDP2, tensor parallel inside a pipeline stage, or a zero-bubble schedule), so there is "
                "no whole-step graph to bucket or reorder.", compile_config.bucketing, compile_config.reorder,
            )
        for block in model.layers.values():
            block.compile(backend=compile_config.backend, fullgraph=True)

    if dims.dp_enabled:
        param_dtype = param_dtype_for(config, device)
        reduce_dtype = DTYPES[config.training.mixed_precision_reduce]
        if simple:
            data_parallel(
                model,
                dp_mesh(mesh, dims),
                mode=dims.data_parallel_mode,
                mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                reshard_after_forward=reshard_after_forward(config, dims),
            )
        else:
            apply_fsdp2(model, dp_mesh(mesh, dims), mode=dims.data_parallel_mode, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward(config, dims))

    if compile_config.enable and not per_block:
        # The whole model in one graph, the collectives included: Inductor sees and schedules them.
        # nn.Module.compile keeps the module (and its state_dict names) as they are. compile_model adds the
        # [compile] bucketing / reordering passes and writes comm_plan.json/.txt to the dump folder.
        compile_model(
            model,
            backend=compile_config.backend,
            bucketing=compile_config.bucketing,
            manual_plan=compile_config.manual_bucketed_modules or None,
            reorder=compile_config.reorder,
            dump_folder=config.job.dump_folder,
        )
    return model
