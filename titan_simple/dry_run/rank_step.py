"""One rank of the planned job, built by the real recipe on the meta device, and one traced training step.

``trace_rank`` is the measuring half of the dry run (``dry_run/run.py``); ``prediction.py`` turns what it measures into
memory, collectives and step time. It runs inside the fake process group that ``run_dry_run`` sets up.

**What runs.** The model goes through the trainer's assembly (``core.assemble.build_run``, left on the meta
device): the pipeline split (``plan_pipeline`` / ``split_stage``) and, per stage, tensor parallel -> activation
checkpointing -> SimpleFSDP (``parallelize_llama``). Then one microbatch's forward, the trainer's loss and
backward per local stage (``core.step``), and the optimizer step, run on meta tensors under
``tracer.StepTracer``: nothing is allocated, but every op, every saved activation, every recomputation and every
collective the real step issues is seen with this rank's shapes. When SimpleFSDP gathers once per step
(``parallel/fsdp_gather.py``) the trace gathers before the microbatch and reduces after it, as the step does:
those collectives are tagged with the phases "gather" / "reduce" (once per step) and the held weights and
gradients are live through the traced forward and backward. torch.compile is not run (it would trace for
minutes); its effect enters the time model only (fused elementwise kernels, overlap). Autocast (bf16 without
data parallel) acts on CUDA / CPU tensors only, not on meta ones: such layouts are traced in fp32, an
over-estimate of their activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_simple.compile.compiler import transformer_block_plan
from titan_simple.compile.regions import (
    EMBEDDING,
    HANDOFF,
    HEAD_BUCKET,
    EmbeddingRegion,
    RegionalForward,
    bucket_modules,
    region_bucket_plan,
)
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import RunPlan
from titan_simple.core.step import TrainStep
from titan_simple.dry_run.tracer import Collective, OpCost, StepTracer, fused_attention, ignoring_shape_propagation
from titan_simple.parallel.tensor_parallel import loss_parallel_context

# How the trace models the fused cross-entropy of a loss compiled with the model (see trace_rank).
FUSED_LOSS_TRACE_CHUNKS = 8


@dataclass
class StageTrace:
    """One local model part (the whole model, or one pipeline stage), one microbatch."""

    stage: int | None
    layers: list[int]
    activation_bytes: int  # what the forward leaves alive for backward
    peak_bytes: int  # live peak during forward + backward (static memory included)
    boundary_bytes: int  # the activation sent to the next stage (pipeline), per microbatch
    buckets: int  # compile bucketing "transformer_block": one per block, embedding, [norm, output]
    parameter_tensors: int
    # Regional compilation: the parameter bytes whose collectives no compute of their graph hides, in bytes of
    # whole buckets' traffic (the embedding's region; each region's last bucket, and its first where it gathers it
    # itself; ``_region_exposed_bytes``).
    region_exposed_bytes: int = 0
    # Regional compilation's hand-off: the weights held unsharded from a region's forward to its backward
    # (``_handoff_held_bytes``; included in ``activation_bytes`` and ``peak_bytes``).
    handoff_held_bytes: int = 0


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def _trace_part(part: nn.Module, stage: int | None, run: RunPlan, tracer: StepTracer, mesh: DeviceMesh | None,
                train_step: TrainStep) -> StageTrace:
    compute_dtype, loss_parallel = run.precision.param_dtype, run.loss.parallel
    plan, dims = run.pipeline, run.dims
    training, parallelism = run.config.training, run.config.parallelism
    batch = parallelism.pipeline_parallel_microbatch_size if plan is not None else training.local_batch_size
    first = plan is None or stage == 0
    last = plan is None or stage == plan.num_stages - 1
    meta = torch.device("meta")
    tokens = torch.zeros(batch, training.seq_len, dtype=torch.long, device=meta)
    labels = torch.zeros(batch, training.seq_len, dtype=torch.long, device=meta)
    attention_inputs = None
    if train_step.parts.context_parallel is not None:  # this rank's share of the sequence, as the step takes it
        tokens, labels, attention_inputs = train_step.parts.context_parallel.shard(tokens, labels, None)
    if first:
        inputs: torch.Tensor = tokens
    else:  # the previous stage's output: the residual stream, sequence-sharded under tensor parallel
        dim = part.args.dim
        local_seq = tokens.shape[1] // dims.tp
        local = torch.empty(batch, local_seq, dim, dtype=compute_dtype, device=meta, requires_grad=True)
        inputs = DTensor.from_local(local, mesh["tp"], [Shard(1)], run_check=False) if dims.tp > 1 else local

    tracer.set_phase("forward")
    before = tracer.live
    with fused_attention():  # no autocast: it keys on the tensors' device and does nothing to meta tensors
        out = part(inputs, attention_inputs)
        if last:
            with loss_parallel_context(loss_parallel):
                loss = train_step.loss(out, labels, 1 / (batch * training.seq_len))  # the trainer's loss, exactly
                if plan is None:
                    del out  # the local step drops the logits after the loss; the pipeline schedule keeps them
                kept = tracer.live - before
                tracer.set_phase("backward")
                loss.backward()
            boundary = 0
        else:
            kept = tracer.live - before
            boundary = _local_bytes([out])
            tracer.set_phase("backward")
            out.backward(torch.empty_like(out))
    peak = max(tracer.phase_peaks.get("forward", 0), tracer.phase_peaks.get("backward", 0))
    # The trace runs the model eagerly, without regions: add what the regional hand-off holds from forward to
    # backward (all of it is alive where forward ends, about where the peak is).
    held = _handoff_held_bytes(part, run)
    layers = [int(name) for name in part.layers.keys()]
    return StageTrace(stage, layers, kept + held, peak + held, boundary, len(transformer_block_plan(part)),
                      sum(1 for _ in part.parameters()), _region_exposed_bytes(part, run), held)


def _region_exposed_bytes(part: nn.Module, run: RunPlan) -> int:
    """``StageTrace.region_exposed_bytes`` of ``part`` in regions of ``run.compile.region_blocks`` blocks
    (``compile/regions.py``). Nothing hides the embedding region's traffic: its forward all-gathers and gradient
    reductions, of the embedding and of the first block region's hand-off (the embedding's backward does not read
    its weight, so it is not gathered again). Nothing hides each block region's last bucket's backward re-gather
    either (reshard after forward only; the last region's last bucket holds the final norm and output too), nor
    the first bucket's forward all-gather and gradient reduction (the first block's attention norm and q / k / v
    projections) of a region that gathers it itself: every region without the hand-off
    (``CompilePlan.region_handoff``), the first under tensor parallel. A bucket's exposed collectives count by
    their share of its data-parallel traffic, each weighed by its dtype's bytes: the all-gathers (none under
    replicate) in ``param_dtype``, the reduction (reduce-scatter, all-reduce, or both under hybrid_shard: one
    share) in ``reduce_dtype``."""
    sharded = run.dims.data_parallel_mode != "replicate"
    gather = torch.finfo(run.precision.param_dtype).bits if sharded else 0
    regather = gather if run.parallel.reshard_after_forward else 0
    reduce = torch.finfo(run.precision.reduce_dtype).bits
    per_bucket = gather + regather + reduce

    def nbytes(modules) -> int:
        return _local_bytes(param for module in modules for param in module.parameters())

    size = run.compile.region_blocks
    forward = RegionalForward(part, size, handoff=run.compile.region_handoff)
    if not forward.regions:  # the embedding, norm and output compile as graphs of their own
        return nbytes(m for name in (EMBEDDING, *HEAD_BUCKET) if (m := getattr(part, name, None)) is not None)
    plan = [[name for name in names if name != HANDOFF] for names in region_bucket_plan(size)]
    exposed = 0.0
    for index, (region, received) in enumerate(zip(forward.regions, forward.receivers, strict=True)):
        if isinstance(region, EmbeddingRegion):  # the embedding, and the first block region's hand-off
            handed_on = forward.receivers[index + 1]
            exposed += nbytes([region.tok_embeddings, *handed_on]) * (gather + reduce) / per_bucket
            continue
        buckets = [modules for names in plan if (modules := bucket_modules(region, names))]
        exposed += ((0 if received else nbytes(buckets[0]) * (gather + reduce)) + nbytes(buckets[-1]) * regather
                    ) / per_bucket
    return int(exposed)


def _handoff_held_bytes(part: nn.Module, run: RunPlan) -> int:
    """The weights the regional hand-off keeps unsharded from a region's forward to its backward: each handed
    region's first block's attention norm and q / k / v projections (``regions.HANDOFF_MODULES``), dp gathered,
    in ``param_dtype`` (a replicated weight is held as itself: nothing more)."""
    if not run.compile.region_handoff or run.dims.data_parallel_mode == "replicate":
        return 0
    if not run.parallel.reshard_after_forward and run.parallel.ac_mode == "none":
        return 0  # the blocks save their gathered weights for backward anyway: the trace counts them already
    itemsize = torch.finfo(run.precision.param_dtype).bits // 8
    forward = RegionalForward(part, run.compile.region_blocks, handoff=True)
    held = 0
    for module in (m for received in forward.receivers for m in received):
        for param in module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            held += local.numel() * run.dims.shard_degree * itemsize
    return held


@contextlib.contextmanager
def _in_phase(tracer: StepTracer, name: str):
    """Count what runs inside as phase ``name``, then go back to the phase it interrupted."""
    previous = tracer.phase
    tracer.set_phase(name)
    try:
        yield
    finally:
        tracer.set_phase(previous)


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state a first optimizer step leaves (Adam / AdamW: a step count and two moments like each parameter),
    created directly: a foreach step over DTensors costs ~0.3 s of sharding propagation per trace. Other
    optimizers take the step."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        optimizer.step()
        return
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            state["step"] = (torch.zeros((), dtype=torch.float32, device=param.device) if on_device
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


@dataclass
class RankTrace:
    parts: list[StageTrace]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_peak_bytes: int
    peak_at: str  # the op after which forward/backward memory peaked
    ops: list[OpCost]
    collectives: list[Collective]
    seconds: float


def _traced_plan(run: RunPlan) -> RunPlan:
    """The plan the trace runs: eager (compiling meta graphs would take minutes; the time model accounts for
    compilation). A loss the step compiles with the model is traced as Inductor's fused cross-entropy keeps it:
    the logits (or their gradient) in their dtype and no fp32 copy, which the chunked loss keeps eagerly."""
    run = run.without_compile()
    if run.loss.compiled_with_model:
        run = dataclasses.replace(run, loss=dataclasses.replace(run.loss, chunks=FUSED_LOSS_TRACE_CHUNKS))
    return run


def trace_rank(run: RunPlan, mesh: DeviceMesh | None) -> RankTrace:
    """Build this rank's model parts by the real recipe on the meta device and trace one step."""
    start = time.perf_counter()
    run = _traced_plan(run)
    # The trainer's build, left on the meta device.
    built = build_run(run, torch.device("meta"), mesh=mesh, materialize=False, lr_schedule=False)
    model_parts, optimizer, train_step = built.parts, built.optimizer, built.step
    parts = model_parts.modules
    pipeline = model_parts.pipeline
    stages: list[int | None] = [stage.stage_index for stage in pipeline.stages] if pipeline else [None]

    # Steady state: gradients and optimizer state exist before the step starts (after step 1).
    params = [param for part in parts for param in part.parameters() if param.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    _create_optimizer_state(optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    tracer = StepTracer()
    with tracer, ignoring_shape_propagation():
        for tensor in [*params, *(param.grad for param in params), *state]:
            tracer.track(tensor)
        for buffer in (b for part in parts for b in part.buffers()):
            tracer.track(buffer)
        if train_step.features:  # float8's one amax all-reduce (and the amaxes): once per step
            tracer.set_phase("gather")
            for feature in train_step.features:
                feature.before_forward()
        gather = model_parts.once_per_step_gather  # once per step: the held weights are alive through every microbatch
        if gather is not None:
            tracer.set_phase("gather")
            gather.phase_scope = partial(_in_phase, tracer)  # its work inside the microbatch: once per step
            # No reduce-scatter starts inside the traced backward: in a step of several microbatches every held
            # gradient is alive until the last one, which is the peak this trace of one microbatch must show.
            # The time model overlaps the reduces (prediction.once_per_step_split).
            gather.gather(microbatches=None)
        results = [_trace_part(part, stage, run, tracer, mesh, train_step)
                   for part, stage in zip(parts, stages, strict=True)]
        if gather is not None:
            tracer.set_phase("reduce")
            gather.reduce()
        peak_at = tracer.peak_at
        tracer.set_phase("optimizer")
        tracer.reset_peaks()
        optimizer.step()
        optimizer_peak = tracer.peak
    return RankTrace(
        parts=results,
        parameter_bytes=_local_bytes(params),
        gradient_bytes=_local_bytes(param.grad for param in params),
        optimizer_bytes=_local_bytes(state),
        optimizer_peak_bytes=optimizer_peak,
        peak_at=peak_at,
        ops=tracer.ops,
        collectives=tracer.collectives,
        seconds=time.perf_counter() - start,
    )
