"""The recipe: how a Llama 3 model becomes a parallel one, in the order it happens.

    tensor parallel -> activation checkpointing -> data parallel (SimpleFSDP or FSDP2) -> torch.compile

Tensor parallel goes first, on the meta model: the data-parallel wrappers then shard its DTensor parameters
further over the dp mesh (the joint (dp, tp) mesh). Pipeline parallel slots in around these steps.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_simple.parallel.compile import compile_model
from titan_simple.parallel.dims import ParallelDims, dp_mesh
from titan_simple.parallel.fsdp2 import apply_fsdp2
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, data_parallel
from titan_simple.parallel.step_gather import choose_gather_mode
from titan_simple.parallel.tensor_parallel import apply_tensor_parallel, keep_gradient_layouts

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX): Linux's CPU flags, the same answer on
    every rank of a machine. Measured with one thread: a [16384, 256] x [256, 768] matmul took 15 ms in bf16
    and 75 ms in fp32 on an AVX512-BF16 EPYC; on a CPU without it bf16 ran about 2x slower than fp32."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def param_dtype_for(config: JobConfig, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with native bf16 (``cpu_has_native_bf16``); fp32 on other CPUs,
    where bf16 is emulated and slower than fp32."""
    name = config.training.mixed_precision_param
    if name == "auto":
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if fast_bf16 else torch.float32
    return DTYPES[name]


def gather_mode(config: JobConfig, dims: ParallelDims) -> str:
    """``per_microbatch`` or ``once_per_step`` (``[parallelism] fsdp_gather``, see ``step_gather.py``); raises
    the ConfigError of a layout that cannot gather once per step."""
    parallelism = config.parallelism
    choice = parallelism.fsdp_gather
    if not dims.dp_enabled or parallelism.fsdp_implementation != "simple":
        if choice == "once_per_step":
            raise ConfigError(
                "[parallelism] fsdp_gather = 'once_per_step' needs SimpleFSDP with data parallel "
                "(fsdp_implementation = 'simple' and a dp degree > 1); FSDP2 under pipeline parallel already "
                "reduces once per step. Use fsdp_gather = 'auto'."
            )
        return "per_microbatch"
    if dims.pp > 1 and parallelism.pipeline_parallel_schedule in ZERO_BUBBLE_SCHEDULES:
        if choice == "once_per_step":
            raise ConfigError(
                f"[parallelism] fsdp_gather = 'once_per_step' does not work with pipeline_parallel_schedule = "
                f"{parallelism.pipeline_parallel_schedule!r} (its split backward computes weight gradients of the "
                "stored parameters, not of held weights); use fsdp_gather = 'auto' or another schedule."
            )
        return "per_microbatch"
    return choose_gather_mode(choice, pipeline=dims.pp > 1, sharded=dims.data_parallel_mode != "replicate")


def reshard_after_forward(config: JobConfig, dims: ParallelDims) -> bool:
    if gather_mode(config, dims) == "once_per_step":
        return False  # the weights are held for the whole step: there is nothing to free after forward
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
# Pipeline schedules that run one stage per pp rank (the others run several).
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


def compile_per_block(config: JobConfig, dims: ParallelDims) -> bool:
    """Compile each transformer block rather than the whole model (or pipeline stage): with FSDP2, whose hooks
    break a whole-model graph (fullgraph fails in torch 2.13), and under the zero-bubble pipeline schedules,
    whose split backward gives wrong weight gradients through a whole compiled stage (measured: some are 0),
    and for tensor parallel inside pipeline stages when a pp rank runs several of them (Interleaved1F1B,
    LoopedBFS): torch 2.13 fails to compile them (AOTAutograd's partitioner: "Node tangents_2 was invalid, but
    is output"; scripts/repro_tp_pp_whole_stage_compile.py). With one stage per rank (GPipe, 1F1B) TP stages
    compile whole."""
    if config.parallelism.fsdp_implementation != "simple":
        return True
    schedule = config.parallelism.pipeline_parallel_schedule
    if dims.pp > 1 and dims.tp > 1 and schedule not in SINGLE_STAGE_SCHEDULES:
        return True
    return dims.pp > 1 and config.parallelism.pipeline_parallel_schedule in ZERO_BUBBLE_SCHEDULES


def compile_whole_model(module: nn.Module, config: JobConfig, plan_root: str = "") -> None:
    """``[compile]`` as one graph: ``module`` compiled in place with the configured bucketing / reordering
    passes; ``plan_root`` names the submodule that holds the transformer blocks (for the bucket plan) when
    ``module`` wraps the model (the training step compiles the model together with its loss)."""
    compile_config = config.compile
    compile_model(
        module,
        backend=compile_config.backend,
        bucketing=compile_config.bucketing,
        manual_plan=compile_config.manual_bucketed_modules or None,
        reorder=compile_config.reorder,
        dump_folder=config.job.dump_folder,
        plan_root=plan_root,
    )


def parallelize_llama(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, config: JobConfig, device: torch.device,
    compile_whole: bool = True,
) -> nn.Module:
    """Apply tensor parallel, activation checkpointing, data parallel and compilation to ``model`` (on the
    meta device). ``compile_whole=False`` leaves a layout that compiles as one graph uncompiled, for the
    caller to compile together with more (the training step adds the loss); per-block compilation is done
    here either way."""
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
        defaults = type(compile_config)()
        if (compile_config.bucketing, compile_config.reorder) != (defaults.bucketing, defaults.reorder):
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

    if compile_config.enable and not per_block and compile_whole:
        # The whole model in one graph, the collectives included: Inductor sees and schedules them.
        # nn.Module.compile keeps the module (and its state_dict names) as they are. compile_model adds the
        # [compile] bucketing / reordering passes and writes comm_plan.json/.txt to the dump folder.
        compile_whole_model(model, config)
    return model
