"""The dry run's model: from one traced rank to per-rank memory, collectives, step time and MFU; the printed table.

``build_report`` takes the ``RankTrace`` of ``rank_step.trace_rank`` and the device (``hardware.DeviceSpec``)
and returns the report (a dict, written as ``dry_run.json``); ``format_report`` prints it. It is kept apart
from the tracing so that the model can be read and changed without the build and tracing machinery.

**Memory** (per rank, measured on the trace): parameters, gradients and optimizer state are the local shards;
activations are what one microbatch's forward leaves alive for backward, times the microbatches the pipeline
schedule keeps in flight; the peak is the traced live maximum (which includes transients such as gathered
weights, logits, the foreach optimizer's temporaries) plus the other in-flight microbatches.

**Time** (a roofline over the traced ops, ``hardware.DeviceSpec``):

* each op: ``max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency))`` plus, in eager mode, a
  launch overhead; compiled, elementwise traffic and launches are cut to ``COMPILED_ELEMENTWISE_FRACTION``
  (Inductor fuses chains of elementwise ops into one kernel); float8 GEMMs at the float8 peak, and a compiled
  float8 cast as the one read and write Inductor fuses it into (``trace._cast_bytes``, docs/dry_run.md);
* each collective: ``latency + wire bytes / (link bandwidth x efficiency)``, ring algorithms (all-gather and
  reduce-scatter move ``(n-1)/n`` of the full tensor per rank, all-reduce twice that); NVLink when the
  group fits in one node (the mesh puts tp innermost, then dp_shard, dp_replicate, pp), else the NIC;
* overlap: data-parallel collectives are hidden behind compute when the compiled graph reorders them
  (``[compile] reorder`` or ``bucketing = auto``; ``[dry_run] comm_overlap`` overrides), except what exceeds
  the compute and what nothing can hide (``exposed_dp_floor``: one bucket's worth in one graph; under
  regional compilation the ends of every graph); tensor-parallel collectives and pipeline
  send/recv sit on the critical path (exposed), except under async tensor parallel
  (``async_tensor_parallel_exposed``);
* pipeline bubble: ``(pp - 1)`` stage passes for GPipe / 1F1B, ``(pp - 1)`` chunk passes (1/v of a stage) for
  the interleaved / looped schedules, a third of that for the zero-bubble ones.

MFU uses the model FLOPs convention of training (``6 N + 12 L H d T`` per token, ``flops_per_token``), so it
is comparable with the trainer's figure; the roofline itself prices what the hardware executes (causal
attention at half, recomputation included).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import torch

from titan_simple.core.plan import RunPlan
from titan_simple.dry_run.hardware import DeviceSpec
from titan_simple.dry_run.mesh_dims import MeshDim, mesh_dims
from titan_simple.dry_run.muon_pricing import newton_schulz_cost
from titan_simple.dry_run.rank_step import RankTrace
from titan_simple.dry_run.tracer import Collective, OpCost
from titan_simple.models.llama3 import count_parameters, flops_per_token
from titan_simple.parallel.pipeline import PipelinePlan

# Share of eager elementwise memory traffic (and kernel launches) left after Inductor fuses elementwise chains:
# a guess (a fused chain reads its inputs and writes its outputs once instead of once per op), not measured.
COMPILED_ELEMENTWISE_FRACTION = 0.5
# How many traced ops apart a TP collective and its matmul may be for async TP to fuse them (the ops between
# are data movement: the sequence-parallel gather's reordering, a contiguous copy before a reduce-scatter).
FUSE_WINDOW = 3
DATA_PARALLEL_DIMS = ("dp_shard", "dp_replicate", "dp", "dp_shard_cp")
# Traced phases whose collectives run once per step, not once per microbatch pass.
ONCE_PER_STEP_PHASES = ("optimizer", "gather", "reduce")


# ---------------------------------------------------------------------------------------------- model


def in_flight_chunks(plan: PipelinePlan | None, pp_rank: int) -> int:
    """Microbatches (per local stage chunk) whose activations this rank holds at its peak, by schedule.
    1F1B: rank r runs ``pp - r`` forwards before its first backward; interleaved: Megatron's warm-up count
    ``(v - 1) pp + 2 (pp - 1 - r)`` plus the one in flight; GPipe / looped BFS: all of them; ZBV: about
    ``2 (pp - r) - 1`` (an approximation)."""
    if plan is None:
        return 1
    pp, n, v = plan.pp, plan.n_microbatches, plan.num_stages // plan.pp
    schedule = plan.schedule
    if schedule == "GPipe":
        return n
    if schedule == "1F1B":
        return min(n, pp - pp_rank)
    if schedule == "LoopedBFS":
        return n * v
    if schedule == "ZBVZeroBubble":
        return min(n * v, 2 * (pp - pp_rank) - 1)
    return min(n * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def op_seconds(op: OpCost, spec: DeviceSpec, compiled: bool) -> float:
    memory = spec.memory_bandwidth * spec.memory_efficiency
    launch = spec.kernel_overhead
    rate = {"matmul": (spec.float8_peak_flops or 0.0) * spec.float8_matmul_efficiency if op.float8 else
            spec.peak_flops * spec.matmul_efficiency, "attention": spec.peak_flops * spec.attention_efficiency}
    if op.category in rate:
        return max(op.flops / rate[op.category], op.nbytes / memory) + launch
    if compiled and op.fused_nbytes is not None:  # a float8 cast's op, priced as Inductor fuses the chain
        return op.fused_nbytes / memory + (launch if op.fused_nbytes else 0.0)
    fraction = COMPILED_ELEMENTWISE_FRACTION if compiled else 1.0
    return fraction * (op.nbytes / memory + launch)


_WIRE_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


def collective_seconds(kind: str, nbytes: float, dim: MeshDim, spec: DeviceSpec, count: int = 1) -> float:
    """Ring algorithms: all-gather / reduce-scatter put ``(n-1)/n`` of the full tensor on each rank's link,
    all-reduce twice that; a point-to-point ``send`` its bytes."""
    bandwidth = (spec.intra_node_bandwidth if dim.intra_node else spec.inter_node_bandwidth)
    wire = nbytes if kind == "send" else _WIRE_FACTOR.get(kind, 1.0) * (dim.size - 1) / dim.size * nbytes
    return count * spec.collective_latency + wire / (bandwidth * spec.collective_efficiency)


def comm_overlapped(run: RunPlan) -> bool:
    """``auto``: overlapped when Inductor reorders the data-parallel collectives of a whole-model (or stage)
    graph, or of each region under regional compilation (``exposed_dp_floor`` says what stays exposed). A layout
    compiled block by block has no such graph."""
    choice = run.config.dry_run.comm_overlap
    if choice != "auto":
        return choice == "overlapped"
    compile_plan = run.compile
    overlapping = compile_plan.whole_graph or compile_plan.mode == "regional"
    return overlapping and (compile_plan.reorder or compile_plan.bucketing == "auto")


def exposed_dp_floor(run: RunPlan, m: Measured, dp_comm_s: float) -> float:
    """The data-parallel seconds no compute can hide even when overlapped: one bucket's in one graph; under
    regional compilation what has nothing of its own graph to run behind, by its share of the parameter bytes
    (``StageTrace.region_exposed_bytes``: the embedding's region, what each block region cannot hide)."""
    if run.compile.mode == "regional":
        return dp_comm_s * m.region_exposed_bytes / max(m.parameters, 1)
    return dp_comm_s / m.buckets


def suggestion(largest: str, run: RunPlan) -> str:
    if run.fsdp_gather == "once_per_step" and largest != "activations":
        return ("[parallelism] fsdp_gather = 'per_microbatch' (gathering once per step holds this rank's unsharded "
                "weights and their gradients through the step), or shard the weights further")
    if largest in ("parameters", "gradients", "optimizer state"):
        return ("shard the weights further: more data_parallel_shard_degree (fewer dp_replicate), or add "
                "tensor_parallel_degree (within a node) / pipeline_parallel_degree")
    if largest == "activations":
        ac = {"none": "[activation_checkpoint] mode = selective or full, ",
              "selective": "[activation_checkpoint] mode = full, "}.get(run.parallel.ac_mode, "")
        return (f"{ac}lower local_batch_size / pipeline_parallel_microbatch_size, or add tensor_parallel_degree "
                "(sequence parallel splits activations)")
    return ("lower local_batch_size, or add tensor_parallel_degree (loss parallel keeps the logits "
            "vocab-sharded); transients are gathered weights, logits and optimizer temporaries")


def fused_matmul_seconds(c: Collective, ops: list[OpCost], seconds_of) -> float | None:
    """The seconds of the matmuls Inductor's async-TP pass would fuse with collective ``c``, found in the eager
    trace as the pass finds them in a compiled graph (``inductor_private.async_tensor_parallel_matches``): an
    all-gather whose output feeds matmuls (the first op after it that is not data movement, within
    ``FUSE_WINDOW`` ops, is a matmul; the consecutive matmuls reading it, e.g. wq, wk, wv, all count), or a
    reduce-scatter whose input is a matmul's output (a matmul within ``FUSE_WINDOW`` ops before it, only data
    movement after it; the sum of several matmuls, as in the backward of column-parallel layers, is more ops
    away and not fused). ``None``: nothing to fuse with. Checked against Inductor's own count on the debug model
    (``tests/test_async_tensor_parallel.py``)."""
    if c.kind == "all_gather":
        window = ops[c.next_op:c.next_op + FUSE_WINDOW]
        start = next((c.next_op + i for i, op in enumerate(window) if op.category != "memory"), None)
        if start is None or ops[start].category != "matmul":
            return None
        end = start
        while end < len(ops) and ops[end].category == "matmul":
            end += 1
        return sum(seconds_of(op) for op in ops[start:end])
    if c.kind == "reduce_scatter":
        before = range(c.next_op - 1, max(c.next_op - 1 - FUSE_WINDOW, -1), -1)
        last = next((i for i in before if ops[i].category != "memory"), None)
        if last is not None and ops[last].category == "matmul":
            return seconds_of(ops[last])
    return None


def async_tensor_parallel_exposed(comm_s: float, matmul_s: float, tp: int) -> float:
    """What stays exposed of a tensor-parallel collective fused with its matmul: the transfer runs in ``tp``
    chunks, each overlapping one chunk of the matmul, so one chunk's transfer (``1/tp``) waits, or more where
    the transfer outlasts the matmul."""
    return max(comm_s - matmul_s, comm_s / tp)


def once_per_step_split(gathers: list[float], reduces: list[float], lazy: bool) -> tuple[float, float]:
    """Seconds of SimpleFSDP's once-per-step gathers and reduces (``parallel/fsdp_gather.py``) that no compute
    hides. Each reduce-scatter starts when its bucket's last gradient is complete and runs while the earlier
    layers' backward does, so only the last one's is exposed: the first bucket in forward order, which the trace
    (it reduces after its microbatch, in forward order) lists first. All gathers start together; in an eager forward
    (``lazy``) each bucket is waited for where its weights are first read, so only the first bucket's gather is
    exposed, while a compiled forward needs them all before it starts. What overlaps is hidden behind one
    microbatch pass of this rank's stages, as far as that pass is long enough: exposed = edges + max(hidden -
    pass, 0) of the (edges, hidden) returned here (``finish_report``)."""
    waited = gathers[:1] if lazy else gathers
    return sum(waited) + (reduces[0] if reduces else 0.0), sum(gathers[len(waited):]) + sum(reduces[1:])


@dataclass
class Measured:
    """What the model reads off one rank's trace under one run plan, before anything is combined: sums and
    maxima over the traced ops, collectives and parts, each linear in the transformer blocks a rank holds (so
    ``depth.extrapolate`` can carry a trace of few blocks to the full depth). ``finish_report`` does the rest."""

    parameters: int
    gradients: int
    optimizer_state: int
    kept: int  # activations one microbatch leaves for backward (the largest local part)
    part_peak: int  # live peak of forward + backward (the largest local part)
    optimizer_peak: int
    regional_handoff: int
    compute_pass: float  # seconds of one microbatch's ops, all local stages
    by_category: dict[str, float]
    optimizer_seconds: float
    matmul_flops: float
    rows: dict[tuple[str, str, str], dict[str, float]]  # (mesh dim, kind, dtype) -> count, bytes, seconds, once
    dp_comm_pass: float
    other_pass: float
    exposed_pass: float
    dp_once_seconds: float
    once_edges: float  # once-per-step gathers / reduce that wait (once_per_step_split)
    once_hidden: float  # ... and those that compute may hide
    p2p_pass: float
    fused_tp: dict[str, float]
    buckets: int
    parameter_tensors: int
    region_exposed_bytes: int
    peak_at: str
    trace_seconds: float


def _new_row() -> dict[str, float]:
    return {"count": 0, "bytes": 0, "seconds": 0.0, "once": 0}


def _pipeline_send_recv(run: RunPlan, trace: RankTrace, rows: dict[tuple[str, str, str], dict[str, float]],
                        pp: MeshDim, spec: DeviceSpec, passes: int) -> float:
    """Seconds per pass of the pipeline's sends and receives (added to ``rows``): per microbatch and stage
    boundary, the activation forward and its gradient backward (the residual stream [microbatch, seq (/tp,
    sequence parallel), dim] in the compute dtype)."""
    dims, plan, training = run.dims, run.pipeline, run.config.training
    assert plan is not None
    dtype = run.precision.param_dtype
    local_seq = training.seq_len // dims.tp if dims.tp > 1 else training.seq_len
    boundary = (run.config.parallelism.pipeline_parallel_microbatch_size * local_seq * run.model_args.dim
                * torch.finfo(dtype).bits // 8)
    total = 0.0
    for part in trace.parts:
        sides = int(part.stage != 0) + int(part.stage != plan.num_stages - 1)
        if sides:
            seconds = 2 * sides * collective_seconds("send", boundary, pp, spec)
            total += seconds
            row = rows[("pp", "send/recv", str(dtype).removeprefix("torch."))]
            row["count"] += 2 * sides * passes
            row["bytes"] += 2 * sides * passes * boundary
            row["seconds"] += passes * seconds
    return total


def _compute_seconds(run: RunPlan, trace: RankTrace, step_ops: list, seconds_of) -> tuple[dict[str, float], float]:
    """The step's compute seconds by op category, and the optimizer's own ops' seconds (Muon's Newton-Schulz
    matmuls, its only ones, are left out: muon_pricing.py prices them whole)."""
    by_category: dict[str, float] = defaultdict(float)
    for op in step_ops:
        by_category[op.category] += seconds_of(op)
    optimizer_s = sum(seconds_of(op) for op in trace.ops if op.phase == "optimizer"
                      and not (run.muon is not None and op.category == "matmul"))
    return by_category, optimizer_s


def measure_trace(run: RunPlan, trace: RankTrace, spec: DeviceSpec, dim_of_group: dict[str, str]) -> Measured:
    """The sums and maxima of ``trace`` that the report is built from (``Measured``)."""
    dims, plan = run.dims, run.pipeline
    mdims = mesh_dims(dims, spec.gpus_per_node)
    world = dims.dp * dims.cp * dims.tp * dims.pp
    compiled = run.compile.enabled
    seconds_of = functools.partial(op_seconds, spec=spec, compiled=compiled)
    step_ops = [op for op in trace.ops if op.phase != "optimizer"]
    by_category, optimizer_s = _compute_seconds(run, trace, step_ops, seconds_of)

    rows: dict[tuple[str, str, str], dict[str, float]] = defaultdict(_new_row)
    dp_comm_pass = exposed_pass = other_pass = dp_once_s = 0.0
    fused_tp: dict[str, float] = defaultdict(int)  # per "phase kind": TP collectives async TP fuses, one pass
    once_gathers: list[float] = []  # SimpleFSDP's once-per-step collectives, in the order they start
    once_reduces: list[float] = []
    passes = (plan.n_microbatches if plan is not None else 1) * run.accumulation_steps
    for c in trace.collectives:
        dim_name = dim_of_group.get(c.group, "world")
        dim = mdims.get(dim_name, MeshDim(dim_name, world, world <= spec.gpus_per_node))
        per_step = 1 if c.phase in ONCE_PER_STEP_PHASES else passes
        seconds = collective_seconds(c.kind, c.nbytes, dim, spec)
        row = rows[(dim_name, c.kind, c.dtype)]
        row["count"] += per_step
        row["bytes"] += per_step * c.nbytes
        row["seconds"] += per_step * seconds
        if c.phase == "optimizer":
            optimizer_s += seconds
        elif c.phase in ("gather", "reduce"):  # SimpleFSDP once per step: already one per bucket
            row["once"] += 1
            dp_once_s += seconds
            (once_gathers if c.phase == "gather" else once_reduces).append(seconds)
        elif dim_name in DATA_PARALLEL_DIMS:
            dp_comm_pass += seconds
        elif (run.compile.async_tensor_parallel and dim_name == "tp"
              and (matmul_s := fused_matmul_seconds(c, trace.ops, seconds_of)) is not None):
            fused_tp[f"{c.phase} {c.kind}"] += 1
            other_pass += seconds
            exposed_pass += async_tensor_parallel_exposed(seconds, matmul_s, dims.tp)
        else:
            other_pass += seconds
            exposed_pass += seconds
    p2p_pass = _pipeline_send_recv(run, trace, rows, mdims["pp"], spec, passes) if plan is not None else 0.0
    once_edges, once_hidden = once_per_step_split(once_gathers, once_reduces, lazy=not compiled)
    return Measured(
        parameters=trace.parameter_bytes, gradients=trace.gradient_bytes, optimizer_state=trace.optimizer_bytes,
        kept=max(part.activation_bytes for part in trace.parts),
        part_peak=max(part.peak_bytes for part in trace.parts), optimizer_peak=trace.optimizer_peak_bytes,
        regional_handoff=max(part.handoff_held_bytes for part in trace.parts),
        compute_pass=sum(by_category.values()), by_category=dict(by_category), optimizer_seconds=optimizer_s,
        matmul_flops=sum(op.flops for op in step_ops), rows=dict(rows), dp_comm_pass=dp_comm_pass,
        other_pass=other_pass, exposed_pass=exposed_pass, dp_once_seconds=dp_once_s,
        once_edges=once_edges, once_hidden=once_hidden, p2p_pass=p2p_pass,
        fused_tp=dict(fused_tp), buckets=sum(part.buckets for part in trace.parts),
        parameter_tensors=sum(part.parameter_tensors for part in trace.parts),
        region_exposed_bytes=sum(part.region_exposed_bytes for part in trace.parts), peak_at=trace.peak_at,
        trace_seconds=trace.seconds,
    )


def build_report(run: RunPlan, pp_rank: int, rank: int, trace: RankTrace, spec: DeviceSpec,
                 dim_of_group: dict[str, str]) -> dict[str, Any]:
    """The memory / time model of ``run``'s rank ``rank`` (pipeline rank ``pp_rank``) over its ``trace``."""
    return finish_report(run, pp_rank, rank, measure_trace(run, trace, spec, dim_of_group), spec)


def _memory(m: Measured, chunks: int, spec: DeviceSpec) -> dict[str, Any]:
    """The rank's memory: the peak of forward/backward with ``chunks`` microbatches' activations in flight, or
    of the optimizer step; reserved (the allocator's view) and the device total (nvidia-smi's)."""
    static = m.parameters + m.gradients + m.optimizer_state
    fwd_bwd_peak = m.part_peak + (chunks - 1) * m.kept
    peak = max(fwd_bwd_peak, m.optimizer_peak)
    activations = chunks * m.kept
    transient = max(peak - static - activations, 0)
    contributors = {"parameters": m.parameters, "gradients": m.gradients, "optimizer state": m.optimizer_state,
                    "activations": activations, "transient (peak - the rest)": transient}
    reserved = peak * (1 + spec.allocator_overhead)  # what torch.cuda.max_memory_reserved would say
    device_total = reserved + spec.runtime_bytes  # what nvidia-smi would say
    return {"bytes": {"parameters": m.parameters, "gradients": m.gradients, "optimizer_state": m.optimizer_state,
                      "activations": activations, "activations_per_microbatch": m.kept,
                      "regional_handoff": m.regional_handoff,  # within the activations
                      "transient": transient, "peak": peak, "reserved": reserved, "device_total": device_total,
                      "device": spec.memory_bytes},
            "largest": max(contributors, key=contributors.__getitem__),
            "peak_at": m.peak_at if fwd_bwd_peak >= m.optimizer_peak else "optimizer step",
            "fits": device_total <= spec.memory_bytes}


def _collective_rows(m: Measured, run: RunPlan, spec: DeviceSpec, world: int) -> list[dict[str, Any]]:
    """Each (mesh dim, kind, dtype) of collectives per step, with its link and its count once bucketed."""
    mdims = mesh_dims(run.dims, spec.gpus_per_node)
    return [
        {"mesh_dim": d, "size": mdims[d].size if d in mdims else world,
         "link": (spec.intra_node_link if (mdims[d].intra_node if d in mdims else world <= spec.gpus_per_node)
                  else "inter-node"), "kind": k,
         "dtype": dt, "count": int(v["count"]), "bytes": int(v["bytes"]), "seconds": v["seconds"],
         # What [compile] bucketing = "transformer_block" merges them into (one collective per bucket).
         "count_bucketed": (int(v["once"]) + round((v["count"] - v["once"]) * m.buckets / m.parameter_tensors)
                            if d in DATA_PARALLEL_DIMS else int(v["count"]))}
        for (d, k, dt), v in sorted(m.rows.items())
    ]


def _step_time(run: RunPlan, m: Measured, passes: int, newton_schulz_s: float = 0.0) -> dict[str, float]:
    """The step's seconds by part: ``passes`` traced microbatches, the data-parallel traffic compute does not
    hide, the pipeline bubble, the optimizer (with Muon's orthogonalizations on their slowest owner)."""
    plan = run.pipeline
    compute_pass, dp_comm_pass = m.compute_pass, m.dp_comm_pass
    if comm_overlapped(run):
        dp_exposed_pass = max(dp_comm_pass - compute_pass, exposed_dp_floor(run, m, dp_comm_pass))
    else:
        dp_exposed_pass = dp_comm_pass
    pass_s = compute_pass + dp_exposed_pass + m.exposed_pass + m.p2p_pass
    bubble = 0.0
    if plan is not None:
        chunk_s = pass_s / (plan.num_stages // plan.pp)
        factor = {"InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 1 / 3}.get(plan.schedule, 1.0)
        bubble = (plan.pp - 1) * chunk_s * factor * run.accumulation_steps
    dp_once_exposed = m.once_edges + max(m.once_hidden - compute_pass, 0.0)  # once_per_step_split
    by_category = defaultdict(float, m.by_category)
    return {
        "compute": passes * compute_pass,
        "compute_matmul": passes * by_category["matmul"],
        "compute_attention": passes * by_category["attention"],
        "compute_elementwise": passes * by_category["memory"],
        "data_parallel_comm": passes * dp_comm_pass + m.dp_once_seconds,
        "data_parallel_comm_exposed": passes * dp_exposed_pass + dp_once_exposed,
        "tensor_parallel_and_other_comm": passes * m.other_pass,
        "tensor_parallel_and_other_comm_exposed": passes * m.exposed_pass,
        "pipeline_send_recv": passes * m.p2p_pass,
        "pipeline_bubble": bubble,
        "optimizer": m.optimizer_seconds + newton_schulz_s,
        "step": passes * pass_s + bubble + m.optimizer_seconds + newton_schulz_s + dp_once_exposed,
    }


def finish_report(run: RunPlan, pp_rank: int, rank: int, m: Measured, spec: DeviceSpec) -> dict[str, Any]:
    """The report of ``run``'s rank ``rank`` from what was measured on its trace (or extrapolated to its depth)."""
    config, dims, plan = run.config, run.dims, run.pipeline
    training = config.training
    args = run.model_args
    world = dims.dp * dims.cp * dims.tp * dims.pp
    accumulation = run.accumulation_steps
    passes = (plan.n_microbatches if plan is not None else 1) * accumulation  # traced microbatch -> per step
    chunks = in_flight_chunks(plan, pp_rank)
    memory = _memory(m, chunks, spec)

    muon = newton_schulz_cost(run, spec)
    time = _step_time(run, m, passes, muon.seconds if muon is not None else 0.0)
    step_s = time["step"]
    roofline_tokens_per_gpu = run.global_tokens / world / step_s
    tokens_per_gpu = roofline_tokens_per_gpu * spec.achieved_fraction
    model_flops = flops_per_token(args, count_parameters(args, exclude_embedding=True), training.seq_len)
    mfu = tokens_per_gpu * model_flops / spec.peak_flops
    return {
        "plan": run.describe(),
        "config": config.config_file,
        "model": config.model.flavor,
        "parameters": count_parameters(args),
        "device": spec.name,
        "world_size": world,
        "rank": rank,
        "mesh": dims.describe,
        "pipeline": None if plan is None else {
            "schedule": plan.schedule, "stages": plan.num_stages, "local_stages": local_stages(plan, pp_rank),
            "microbatches": plan.n_microbatches, "in_flight_chunks": chunks},
        "local_batch_size": training.local_batch_size,
        "seq_len": training.seq_len,
        "activation_checkpoint": run.parallel.ac_mode
        + (f" ({run.parallel.ac_option})" if run.parallel.ac_mode == "selective" else ""),
        "compiled": run.compile.enabled,
        "fsdp_gather": run.fsdp_gather,
        "comm_overlapped": comm_overlapped(run),
        "async_tensor_parallel": ({"fused_collectives_per_pass": int(sum(m.fused_tp.values())),
                                   "fused": {k: int(v) for k, v in m.fused_tp.items()}}
                                  if run.compile.async_tensor_parallel else None),
        "muon": None if muon is None else dataclasses.asdict(muon),
        "memory_bytes": memory["bytes"],
        "peak_at": memory["peak_at"],
        "fits": memory["fits"],
        "largest_contributor": memory["largest"],
        "suggestion": None if memory["fits"] else suggestion(memory["largest"], run),
        "collectives_per_step": _collective_rows(m, run, spec, world),
        "time_seconds": time,
        "hardware_flops_per_step": passes * m.matmul_flops,
        "tokens_per_second_per_gpu": tokens_per_gpu,
        "roofline_tokens_per_second_per_gpu": roofline_tokens_per_gpu,
        "mfu": mfu,
        "trace_seconds": m.trace_seconds,
        "device_spec": asdict(spec),
    }


def local_stages(plan: PipelinePlan | None, pp_rank: int) -> list[int | None]:
    return [None] if plan is None else plan.stages_of_rank(pp_rank)
