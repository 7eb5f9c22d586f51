"""The recipe: how a Llama 3 model becomes a parallel one, in the order it happens.

    tensor parallel -> context parallel -> activation checkpointing -> data parallel (SimpleFSDP or FSDP2)
    -> torch.compile

Tensor parallel goes first, on the meta model: the data-parallel wrappers then shard its DTensor parameters
further over the dp mesh (the joint (dp, tp) mesh). Pipeline parallel slots in around these steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_simple.parallel.context_parallel import apply_context_parallel, context_parallel_mesh
from titan_simple.parallel.dims import ParallelDims, dp_mesh, tensor_parallel_mesh
from titan_simple.parallel.float8_gather import enable_float8_all_gather
from titan_simple.parallel.fsdp2 import apply_fsdp2
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, data_parallel
from titan_simple.parallel.tensor_parallel import apply_tensor_parallel, keep_gradient_layouts
from titan_simple.parallel.torch_private import enable_symmetric_memory

logger = logging.getLogger(__name__)


class Compiles(Protocol):
    """What the recipe asks of the run's compile plan (``compile/compile_plan.CompilePlan``): which mode, and how to
    compile a block, a model's regions or a whole model. The compiler sits above the parallelisms (it buckets
    SimpleFSDP's collectives), so ``parallel/`` names only this."""

    mode: str  # off | whole | per_block | regional
    async_tensor_parallel: bool

    def compile_block(self, block: nn.Module) -> None: ...

    def compile_regional(self, model: nn.Module) -> object | None: ...  # the comm plan recorder, or None

    def compile_whole(self, model: nn.Module) -> object | None: ...


@dataclass(frozen=True)
class ParallelPlan:
    """What the recipe applies to a model (or a pipeline stage). Decided once per run by ``core/plan.py``;
    nothing here reads the config."""

    dims: ParallelDims
    loss_parallel: bool  # tensor parallel leaves the logits vocab-sharded (the loss runs under loss_parallel)
    ac_mode: str  # none | full | selective
    ac_option: str  # selective: "op" or every N-th block
    fsdp_implementation: str  # simple (SimpleFSDP) | fsdp2
    param_dtype: torch.dtype  # what data parallel gathers and computes in
    reduce_dtype: torch.dtype  # what gradients are reduced in
    reshard_after_forward: bool
    compile: Compiles
    float8_all_gather: bool = False  # SimpleFSDP gathers tensorwise float8 weights in float8
    float8_tensor_parallel: bool = False  # torchao's float8 TP styles for tensorwise float8 linears
    save_float8_amax: bool = True  # selective op AC saves float8 amaxes ([float8] stable_recompute)


def parallelize_llama(model: nn.Module, mesh: DeviceMesh | None, plan: ParallelPlan) -> object | None:
    """Apply tensor parallel, context parallel, activation checkpointing, data parallel and compilation to
    ``model`` (on the meta device), in place: each swaps or hooks modules, none sets an attribute on the model.
    Returns the compile's comm plan recorder (``compile/comm_plan.py``; None when nothing compiled with
    Inductor's pass), which the build keeps. A ``whole_with_loss`` compile is left to the build (``core/build.py``
    compiles the model together with its loss); every other compile mode is done here."""
    dims = plan.dims
    if dims.tp > 1:
        apply_tensor_parallel(model, tensor_parallel_mesh(mesh), loss_parallel=plan.loss_parallel,
                              float8=plan.float8_tensor_parallel)
        if plan.compile.async_tensor_parallel:
            # Inductor fuses a TP collective with its matmul only on groups with symmetric memory enabled.
            enable_symmetric_memory(tensor_parallel_mesh(mesh).get_group().group_name)
        if not dims.wraps_data_parallel:
            keep_gradient_layouts(model)  # the data-parallel wrappers would otherwise do it
    if dims.cp > 1:  # before activation checkpointing wraps the blocks
        apply_context_parallel(model, context_parallel_mesh(mesh))

    if plan.ac_mode != "none":
        tp_groups = [tensor_parallel_mesh(mesh).get_group().group_name] if dims.tp > 1 else []
        apply_activation_checkpointing(model.layers, plan.ac_mode, plan.ac_option, tensor_parallel_groups=tp_groups,
                                       save_float8_amax=plan.save_float8_amax)

    if plan.compile.mode == "per_block":
        for block in model.layers.values():
            plan.compile.compile_block(block)

    if dims.wraps_data_parallel:
        if plan.fsdp_implementation == "simple":
            data_parallel(
                model,
                dp_mesh(mesh, dims),
                mode=dims.data_parallel_mode,
                mp_policy=MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype),
                reshard_after_forward=plan.reshard_after_forward,
            )
            if plan.float8_all_gather:
                enable_float8_all_gather(model)
        else:
            apply_fsdp2(model, dp_mesh(mesh, dims), mode=dims.data_parallel_mode, param_dtype=plan.param_dtype,
                        reduce_dtype=plan.reduce_dtype, reshard_after_forward=plan.reshard_after_forward)

    if plan.compile.mode == "regional":
        return plan.compile.compile_regional(model)
    if plan.compile.mode == "whole":
        # The whole model in one graph, the collectives included: Inductor sees and schedules them.
        # nn.Module.compile keeps the module (and its state_dict names) as they are. The [compile] bucketing /
        # reordering passes run, and comm_plan.json/.txt go to the dump folder.
        return plan.compile.compile_whole(model)
    return None
