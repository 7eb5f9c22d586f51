"""Cheap bounds on a layout, from the model's shapes and one traced block: what the search prunes with.

``memory_floor`` estimates from below the memory the dry run will predict: parameters, gradients and AdamW state
of rank 0's parts, sharded by tensor parallel and the shard degree, the weights held under once-per-step
gathering, and half the activations its schedule keeps in flight of its largest part, as one block of its class
keeps them. ``speed_ceiling`` estimates from above the tokens/s it will predict: the compute and exposed
tensor-parallel traffic of rank 0's blocks (as one block of the same class costs without pipeline parallel), and
of the embedding, head and loss where rank 0 runs the head, with the pipeline bubble they imply, or the
data-parallel traffic's floor where that is longer, plus the pipeline's send/recv, times ``CEILING_MARGIN``.
Neither is a proof: blocks inside a pipeline stage came out up to 6% cheaper and kept less than their class on
the debug model, hence the margins; the search's test checks both on every priced layout of a debug search."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_simple.dry_run.hardware import DeviceSpec
from titan_simple.dry_run.layouts import Layout
from titan_simple.dry_run.mesh_dims import mesh_dims
from titan_simple.dry_run.prediction import collective_seconds, in_flight_chunks
from titan_simple.models.llama3 import ModelArgs, count_parameters
from titan_simple.parallel.dims import ParallelDims
from titan_simple.parallel.pipeline import V_SCHEDULES, PipelinePlan, _split_evenly

ADAM_BYTES_PER_PARAMETER = 16  # fp32 parameter 4 + gradient 4 + AdamW's two moments 8
CEILING_MARGIN = 1.10  # see the module docstring
# An interleaved debug pipeline stage's blocks kept less than its class's block x the chunks in flight (the floor
# came out 14% above the prediction); half of that is the activations' floor.
ACTIVATION_FLOOR_FRACTION = 0.5
BUBBLE_FACTOR = {"InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 1 / 3}  # as prediction.finish_report


@dataclass(frozen=True)
class ModelSizes:
    block: int  # parameters of one transformer block
    embedding: int
    head: int  # final norm + output projection

    @classmethod
    def of(cls, args: ModelArgs) -> ModelSizes:
        one = count_parameters(dataclasses.replace(args, n_layers=1))
        two = count_parameters(dataclasses.replace(args, n_layers=2))
        embedding = args.vocab_size * args.dim
        return cls(block=two - one, embedding=embedding, head=one - (two - one) - embedding)


def pipeline_of(layout: Layout, n_layers: int) -> PipelinePlan | None:
    values = layout.values
    pp = layout.degree("pipeline_parallel")
    if pp == 1:
        return None
    schedule = values["parallelism.pipeline_parallel_schedule"]
    stages = pp * (1 if schedule in ("GPipe", "1F1B") else 2)
    sizes = _split_evenly(n_layers, stages)
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    n_micro = int(values["training.local_batch_size"]) // int(values["parallelism.pipeline_parallel_microbatch_size"])
    return PipelinePlan(schedule, pp, tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(stages)), n_micro)


def rank0_blocks(plan: PipelinePlan | None, n_layers: int) -> list[int]:
    """Blocks of each of rank 0's parts."""
    return [n_layers] if plan is None else [len(plan.stage_layers[s]) for s in plan.stages_of_rank(0)]


def memory_floor(layout: Layout, args: ModelArgs, sizes: ModelSizes, spec: DeviceSpec, held_bytes: float = 0.0,
                 kept_per_block: float = 0.0) -> float:
    """Bytes on rank 0's device the dry run will predict at least (see the module docstring). Where SimpleFSDP
    gathers once per step, the unsharded weights and gradients it holds through the step add ``held_bytes`` per
    parameter (of rank 0's, tensor-parallel sharded); the activations its schedule keeps in flight of its largest
    part add ``kept_per_block`` per block, times ``ACTIVATION_FLOOR_FRACTION``."""
    plan = pipeline_of(layout, args.n_layers)
    blocks = rank0_blocks(plan, args.n_layers)
    holds_head = plan is None or plan.schedule in V_SCHEDULES
    parameters = sizes.embedding + sum(blocks) * sizes.block + (sizes.head if holds_head else 0)
    shards = layout.degree("tensor_parallel") * layout.degree("data_parallel_shard") * layout.degree("context_parallel")
    static = parameters / shards * ADAM_BYTES_PER_PARAMETER
    if layout.values.get("parallelism.fsdp_gather") == "once_per_step":
        static += parameters / layout.degree("tensor_parallel") * held_bytes
    activations = ACTIVATION_FLOOR_FRACTION * in_flight_chunks(plan, 0) * max(blocks) * kept_per_block
    return (static + activations) * (1 + spec.allocator_overhead) + spec.runtime_bytes


def data_parallel_floor(layout: Layout, args: ModelArgs, sizes: ModelSizes, spec: DeviceSpec, gather_bytes: float,
                        reduce_bytes: float) -> tuple[float, float]:
    """Seconds (per microbatch pass, per step) of the data-parallel traffic the dry run will price at least:
    rank 0's weights all-gathered once (forward) and their gradients reduce-scattered (or all-reduced,
    replicated), with no per-collective latency; where SimpleFSDP gathers once per step, that one all-gather,
    which a compiled step waits for (``prediction.once_per_step_split``), per step."""
    once = layout.values.get("parallelism.fsdp_gather") == "once_per_step"
    plan = pipeline_of(layout, args.n_layers)
    blocks = rank0_blocks(plan, args.n_layers)
    holds_head = plan is None or plan.schedule in V_SCHEDULES
    parameters = (sizes.embedding + sum(blocks) * sizes.block + (sizes.head if holds_head else 0)) / layout.degree(
        "tensor_parallel")
    replicate, cp = layout.degree("data_parallel_replicate"), layout.degree("context_parallel")
    dims = ParallelDims(dp_replicate=replicate, dp_shard=layout.degree("data_parallel_shard"),
                        tp=layout.degree("tensor_parallel"), pp=layout.degree("pipeline_parallel"), cp=cp,
                        world_size=replicate * layout.degree("data_parallel_shard") * cp * layout.degree(
                            "tensor_parallel") * layout.degree("pipeline_parallel"))
    shard, names = dims.shard_degree, dims.shard_names
    mdim = mesh_dims(dims, spec.gpus_per_node)[names[0]] if names else None
    seconds = 0.0
    if once:  # per step, not per pass: a compiled step waits for every once-per-step gather before it starts
        return 0.0, collective_seconds("all_gather", parameters * gather_bytes, mdim, spec, count=0) if (
            shard > 1) else 0.0
    if shard > 1:
        seconds += collective_seconds("all_gather", parameters * gather_bytes, mdim, spec, count=0)
        seconds += collective_seconds("reduce_scatter", parameters * reduce_bytes, mdim, spec, count=0)
    if replicate > 1:
        seconds += collective_seconds("all_reduce", parameters / shard * reduce_bytes,
                                      mesh_dims(dims, spec.gpus_per_node)["dp_replicate"], spec, count=0)
    return seconds, 0.0


def speed_ceiling(layout: Layout, args: ModelArgs, block_seconds: float, ends_seconds: float, global_tokens: int,
                  world_size: int, spec: DeviceSpec, dp_floor: tuple[float, float] = (0.0, 0.0),
                  boundary_bytes: float = 0.0) -> float:
    """Tokens/s/GPU the dry run will predict at most (see the module docstring). A pass takes at least its
    compute or its data-parallel traffic, whichever is longer (``dp_floor``), plus its exposed TP traffic."""
    values = layout.values
    plan = pipeline_of(layout, args.n_layers)
    blocks = rank0_blocks(plan, args.n_layers)
    holds_head = plan is None or plan.schedule in V_SCHEDULES  # rank 0 runs the output and the loss too
    per_pass = sum(blocks) * block_seconds + (max(ends_seconds, 0.0) if holds_head else 0.0)
    per_pass = max(per_pass, dp_floor[0])  # exposed TP (in per_pass) is at least 0: the max stays a lower bound
    if plan is not None:  # pipeline send/recv, priced as prediction.measure_trace does (exposed)
        pp_dim = mesh_dims(ParallelDims(1, world_size // plan.pp, 1, plan.pp, world_size), spec.gpus_per_node)["pp"]
        for stage in plan.stages_of_rank(0):
            sides = int(stage != 0) + int(stage != plan.num_stages - 1)
            per_pass += 2 * sides * collective_seconds("send", boundary_bytes, pp_dim, spec)
    dp = layout.degree("data_parallel_replicate") * layout.degree("data_parallel_shard")
    rows = int(values["training.global_batch_size"]) // dp
    accumulation = rows // int(values["training.local_batch_size"])
    passes = accumulation * (plan.n_microbatches if plan is not None else 1)
    step = passes * per_pass + dp_floor[1]
    if plan is not None:
        chunk = per_pass / len(blocks)
        step += (plan.pp - 1) * chunk * BUBBLE_FACTOR.get(plan.schedule, 1.0) * accumulation
    return CEILING_MARGIN * global_tokens / world_size / step * spec.achieved_fraction if step > 0 else float("inf")
