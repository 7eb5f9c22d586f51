"""Cheap bounds on a layout, from the model's shapes and one traced block: what the search prunes with.

``memory_floor`` is at most the reserved memory the dry run will predict (parameters, gradients and AdamW state
of rank 0's parts, sharded by tensor parallel and the shard degree, plus the activations its schedule keeps of
its blocks alone); ``speed_ceiling`` is at least the tokens/s it will predict (the compute and exposed
tensor-parallel traffic of rank 0's blocks, and of the embedding, head and loss where rank 0 runs the head, with
the pipeline bubble they imply; no data-parallel or pipeline traffic, no optimizer). A layout
whose floor does not fit, or whose ceiling is below the rows already found, cannot enter the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_simple.models.llama3 import ModelArgs
from titan_simple.parallel.pipeline import V_SCHEDULES, PipelinePlan, _split_evenly
from titan_simple.planning.hardware import DeviceSpec
from titan_simple.planning.layouts import Layout
from titan_simple.planning.report import count_parameters_of, in_flight_chunks

ADAM_BYTES_PER_PARAMETER = 16  # fp32 parameter 4 + gradient 4 + AdamW's two moments 8
BUBBLE_FACTOR = {"InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 1 / 3}  # as report.finish_report


@dataclass(frozen=True)
class ModelSizes:
    block: int  # parameters of one transformer block
    embedding: int
    head: int  # final norm + output projection

    @classmethod
    def of(cls, args: ModelArgs) -> ModelSizes:
        one = count_parameters_of(dataclasses.replace(args, n_layers=1))
        two = count_parameters_of(dataclasses.replace(args, n_layers=2))
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


def memory_floor(layout: Layout, args: ModelArgs, sizes: ModelSizes, spec: DeviceSpec,
                 kept_per_block: int = 0) -> float:
    """Bytes on rank 0's device the dry run will predict at least (see the module docstring)."""
    plan = pipeline_of(layout, args.n_layers)
    blocks = rank0_blocks(plan, args.n_layers)
    holds_head = plan is None or plan.schedule in V_SCHEDULES
    parameters = sizes.embedding + sum(blocks) * sizes.block + (sizes.head if holds_head else 0)
    shards = layout.degree("tensor_parallel") * layout.degree("data_parallel_shard")
    static = parameters / shards * ADAM_BYTES_PER_PARAMETER
    activations = in_flight_chunks(plan, 0) * max(blocks) * kept_per_block
    return (static + activations) * (1 + spec.allocator_overhead) + spec.runtime_bytes


def speed_ceiling(layout: Layout, args: ModelArgs, block_seconds: float, ends_seconds: float, global_tokens: int,
                  world_size: int, spec: DeviceSpec) -> float:
    """Tokens/s/GPU the dry run will predict at most (see the module docstring)."""
    values = layout.values
    plan = pipeline_of(layout, args.n_layers)
    blocks = rank0_blocks(plan, args.n_layers)
    holds_head = plan is None or plan.schedule in V_SCHEDULES  # rank 0 runs the output and the loss too
    per_pass = sum(blocks) * block_seconds + (max(ends_seconds, 0.0) if holds_head else 0.0)
    dp = layout.degree("data_parallel_replicate") * layout.degree("data_parallel_shard")
    rows = int(values["training.global_batch_size"]) // dp
    accumulation = rows // int(values["training.local_batch_size"])
    passes = accumulation * (plan.n_microbatches if plan is not None else 1)
    step = passes * per_pass
    if plan is not None:
        chunk = per_pass / len(blocks)
        step += (plan.pp - 1) * chunk * BUBBLE_FACTOR.get(plan.schedule, 1.0) * accumulation
    return global_tokens / world_size / step * spec.achieved_fraction if step > 0 else float("inf")
