"""SimpleFSDP gathering once per step (``parallel/fsdp_gather.py``, ``[parallelism] fsdp_gather``).

Gradient accumulation (dp_shard2, 4 accumulation steps, 2 processes) and pipeline parallel (pp2 x dp_shard2, 8
microbatches, 4 processes), 10 steps, fp32: once per step the data-parallel all-gathers and reduce-scatters of a
step equal the buckets (one per block, embedding, norm, output), per microbatch they are multiplied by the
microbatches; the losses of both modes equal the single-process reference (1e-6 eager, 1e-5 compiled).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed_utils import run_on_ranks
from tests.parity import COMPILED_RTOL, EAGER_RTOL, Recipe, build_layout, max_rel_diff, train_reference
from titan_simple.config import load_job_config
from titan_simple.core.plan import choose_fsdp_gather
from titan_simple.errors import ConfigError
from titan_simple.parallel import fsdp_gather
from titan_simple.parallel.dims import ParallelDims
from titan_simple.parallel.fsdp_gather import StepGather
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, chunk_rows, data_parallel

STEPS = 4  # steps 2-4 run on Adam's state and the gathered weights of updated shards
N_LAYERS = 4  # debug model blocks: 2 per pipeline stage
BLOCKS = (f"--model.n_layers={N_LAYERS}",)
ACCUMULATION = Recipe(global_batch=8, steps=STEPS, extra=BLOCKS)  # 2 dp ranks x 4 accumulation steps of 1 sequence
PIPELINE = Recipe(global_batch=16, steps=STEPS, extra=BLOCKS)  # 2 dp ranks x 8 pipeline microbatches of 1 sequence
DEBUG_TENSORS = N_LAYERS * 9 + 3  # parameter tensors of the debug model: 9 per block, embedding, norm, output
BUCKETS = N_LAYERS + 3  # one per block, embedding, norm, output
WAITS_BEFORE_BLOCK = list(range(1, N_LAYERS + 1))  # the embedding, then one more block each


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d functional collectives DTensor issues (eager only: a dispatch mode stops compilation)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.events: list[tuple[str, int]] = []  # in order: collectives started, and _record_order's events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in (
                "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            self.counts[name] = self.counts.get(name, 0) + 1
            self.events.append((name, -1))
        return func(*args, **(kwargs or {}))


def _record_order(model, events: list) -> None:
    """Append ("forward", i) when block i's forward starts, ("backward", i) when its backward starts, and
    ("unpack", bucket) where StepGather waits for a bucket's all-gather and makes its held weights."""
    original = fsdp_gather._HeldBucket._unpack

    def unpack(self):
        events.append(("unpack", self.index))
        return original(self)

    fsdp_gather._HeldBucket._unpack = unpack  # in this spawned rank process only
    for i, block in enumerate(model.layers.values()):
        def forward_pre(_module, _args, i=i):
            events.append(("forward", i))

        def forward(_module, _args, output, i=i):
            if output.requires_grad:
                output.register_hook(lambda _grad: events.append(("backward", i)))

        block.register_forward_pre_hook(forward_pre)
        block.register_forward_hook(forward)


def _train(config, world_size: int, recipe: Recipe, batches_per_step: int, count: bool) -> dict:
    """``recipe.steps`` steps, each rank's rows cut into ``batches_per_step`` accumulation batches; the global
    mean losses, and the collectives of the last step."""
    layout = build_layout(config, world_size)
    rows = recipe.global_batch // layout.dp_size
    mine = slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows)
    out: dict = {"losses": []}
    events: list = []
    if count and layout.parts.pipeline is None:
        _record_order(layout.parts.model, events)
    for step in range(recipe.steps):
        inputs, labels = recipe.batch(step)
        inputs, labels = inputs[mine], labels[mine]
        batches = [(inputs[i::batches_per_step], labels[i::batches_per_step]) for i in range(batches_per_step)]
        events.clear()
        if count and step == recipe.steps - 1:  # the last step's collectives (the dispatch mode slows every op)
            counter = CollectiveCounter()
            counter.events = events
            with counter:
                result = layout.step(batches)
            out["collectives"] = counter.counts
            out["events"] = list(events)
        else:
            result = layout.step(batches)
        loss_sum = result.loss_sum.clone()
        dist.all_reduce(loss_sum, group=layout.mesh["dp_shard"].get_group())
        out["losses"].append(loss_sum.item() / result.global_tokens)
    gather = layout.parts.once_per_step_gather
    out["buckets"] = None if gather is None else len(gather.buckets)
    out["stages"] = [s.stage_index for s in layout.parts.pipeline.stages] if layout.parts.pipeline else None
    return out


def _run(rank: int, world_size: int, recipe: Recipe, layout: tuple[str, ...], batches_per_step: int,
         cases: dict[str, tuple[str, ...]]) -> dict:
    return {name: _train(recipe.config(*layout, *extra), world_size, recipe, batches_per_step,
                         count="compile" not in name)
            for name, extra in cases.items()}


CASES = {
    "per_microbatch": ("--parallelism.fsdp_gather=per_microbatch",),
    "once_per_step": ("--parallelism.fsdp_gather=once_per_step",),
    "once_per_step/compiled": ("--parallelism.fsdp_gather=once_per_step", "--compile.enable"),
}
# Compiled once-per-step gathering under pipeline parallel is what the plan picks by itself there, trained against
# one process by tests/test_pipeline.py (Interleaved1F1B/compiled) and tests/test_composition.py.
PIPELINE_CASES = {name: extra for name, extra in CASES.items() if "compiled" not in name}


@pytest.fixture(scope="module")
def accumulation() -> list[dict]:
    layout = ("--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=1",
              "--training.global_batch_size=8")
    return run_on_ranks(_run, 2, args=(ACCUMULATION, layout, 4, CASES))


@pytest.fixture(scope="module")
def pipeline() -> list[dict]:
    layout = ("--parallelism.data_parallel_shard_degree=2", "--parallelism.pipeline_parallel_degree=2",
              "--parallelism.pipeline_parallel_schedule=1F1B", "--training.local_batch_size=8",
              "--parallelism.pipeline_parallel_microbatch_size=1")
    return run_on_ranks(_run, 4, args=(PIPELINE, layout, 1, PIPELINE_CASES))


@pytest.mark.slow
def test_accumulation_gathers_once_per_step(accumulation):
    reference = train_reference(ACCUMULATION, keep_grads=False)["losses"]
    for rank in accumulation:
        assert rank["once_per_step"]["buckets"] == BUCKETS
        # Per microbatch: every tensor gathered in forward and again in backward (resharding), reduced once.
        assert rank["per_microbatch"]["collectives"] == {"all_gather_into_tensor": 2 * 4 * DEBUG_TENSORS,
                                                         "reduce_scatter_tensor": 4 * DEBUG_TENSORS}
        assert rank["once_per_step"]["collectives"] == {"all_gather_into_tensor": BUCKETS,
                                                        "reduce_scatter_tensor": BUCKETS}
        assert max_rel_diff(rank["per_microbatch"]["losses"], reference) <= EAGER_RTOL
        assert max_rel_diff(rank["once_per_step"]["losses"], reference) <= EAGER_RTOL
        assert max_rel_diff(rank["once_per_step"]["losses"], rank["per_microbatch"]["losses"]) <= EAGER_RTOL
        assert max_rel_diff(rank["once_per_step/compiled"]["losses"], reference) <= COMPILED_RTOL


@pytest.mark.slow
def test_once_per_step_gathers_and_reduces_overlap_the_first_and_last_microbatch(accumulation):
    """The step's edges overlap compute. All 7 all-gathers start before the first block runs, but each bucket
    is waited for where its weights are first read: block i's gather is waited for after block i-1 has started.
    In the last microbatch's backward, a bucket's reduce-scatter starts as soon as its gradients are complete,
    while the earlier blocks' backward still runs; only the first blocks' and the embedding's come after."""
    for rank in accumulation:
        events = rank["once_per_step"]["events"]
        first_forward = events.index(("forward", 0))
        assert [e for e in events[:first_forward] if e[0] == "all_gather_into_tensor"] == [
            ("all_gather_into_tensor", -1)] * BUCKETS
        waits_before = [sum(1 for e in events[:events.index(("forward", i))] if e[0] == "unpack")
                        for i in range(N_LAYERS)]
        assert waits_before == WAITS_BEFORE_BLOCK, waits_before
        last = N_LAYERS - 1
        last_backward = [i for i, e in enumerate(events) if e == ("backward", last)][-1]  # the last microbatch's
        reduce = ("reduce_scatter_tensor", -1)
        # The output's and the norm's reduce-scatters start before the last block's backward; block k's as block k-1's
        # backward starts; block 0's and the embedding's last.
        assert events[last_backward - 2: last_backward] == [reduce, reduce]
        expected = [e for k in range(last, -1, -1) for e in (("backward", k), reduce)] + [reduce]
        assert events[last_backward:] == expected, events[last_backward:]


@pytest.mark.slow
def test_pipeline_gathers_once_per_step(pipeline):
    reference = train_reference(PIPELINE, keep_grads=False)["losses"]
    for rank in pipeline:
        stage = rank["once_per_step"]["stages"]
        blocks = N_LAYERS // 2
        buckets = blocks + (1 if stage == [0] else 2)  # blocks + embedding | blocks + norm + output
        tensors = blocks * 9 + (1 if stage == [0] else 2)
        assert rank["once_per_step"]["buckets"] == buckets
        # Per microbatch (no resharding under PP by default): one all-gather and one reduce-scatter per tensor
        # and microbatch.
        assert rank["per_microbatch"]["collectives"] == {"all_gather_into_tensor": 8 * tensors,
                                                         "reduce_scatter_tensor": 8 * tensors}
        assert rank["once_per_step"]["collectives"] == {"all_gather_into_tensor": buckets,
                                                        "reduce_scatter_tensor": buckets}
        assert max_rel_diff(rank["per_microbatch"]["losses"], reference) <= EAGER_RTOL
        assert max_rel_diff(rank["once_per_step"]["losses"], reference) <= EAGER_RTOL


# ---------------------------------------------------------------------------------------------- the pieces


def test_chunk_rows_is_dtensors_split():
    for size in range(0, 12):
        for n in (1, 2, 3, 4, 8):
            expected = [len(c) for c in torch.arange(size).chunk(n)] if size else []
            assert chunk_rows(size, n) == expected + [0] * (n - len(expected)), (size, n)


@pytest.mark.parametrize(("overrides", "expected"), [
    ((), "per_microbatch"),  # no pipeline: holding the whole model unsharded would undo FSDP
    (("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"), "once_per_step"),
    (("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
      "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"), "per_microbatch"),
    (("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
      "--parallelism.fsdp_implementation=fsdp2"), "per_microbatch"),
    (("--parallelism.fsdp_gather=once_per_step",), "once_per_step"),
])
def test_auto_gather_mode(overrides, expected):
    config = load_job_config(["--config", "llama3_debug.toml", *overrides])
    assert choose_fsdp_gather(config, ParallelDims.from_config(config, 4)) == expected


@pytest.mark.parametrize(("overrides", "message"), [
    (("--parallelism.fsdp_implementation=fsdp2",), "needs SimpleFSDP"),
    (("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
      "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"), "does not work with"),
])
def test_once_per_step_where_it_cannot_work_is_a_config_error(overrides, message):
    config = load_job_config(["--config", "llama3_debug.toml", "--parallelism.fsdp_gather=once_per_step", *overrides])
    with pytest.raises(ConfigError, match=message):
        choose_fsdp_gather(config, ParallelDims.from_config(config, 4))


class _Uneven(nn.Module):
    """Dim-0 sizes that 2 ranks cannot split evenly, and a parameter a step may leave unused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _grads_both_ways(rank: int, world_size: int, mode: str, param_dtype) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    batches = [torch.randn(3, 4) for _ in range(3)]
    grads = {}
    for once in (False, True):
        torch.manual_seed(1)
        model = data_parallel(_Uneven(), mesh, mode=mode,
                              mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
        gather = StepGather([model]) if once else None
        if gather:
            gather.gather()
        for x in batches:  # every rank computes on its own microbatches: rank-dependent data
            model((x * (rank + 1)).to(param_dtype)).float().square().sum().backward()
        if gather:
            gather.reduce()
            assert all(m._held_unsharded is None for m in model.modules() if hasattr(m, "_gather_specs"))
        grads[once] = {n: (p.grad.full_tensor() if p.grad is not None else None) for n, p in model.named_parameters()}
    return grads


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "param_dtype", "rtol"), [
    ("fully_shard", torch.float32, 1e-6),
    ("replicate", torch.float32, 1e-6),
    ("fully_shard", torch.bfloat16, 1e-2),  # bf16 compute; both reduce in fp32 (once: a fp32 accumulator)
])
def test_uneven_shards_unused_parameters_and_mixed_precision(mode, param_dtype, rtol):
    per_microbatch, once = run_on_ranks(_grads_both_ways, 2, args=(mode, param_dtype))[0].values()
    assert once.keys() == per_microbatch.keys()
    for name, expected in per_microbatch.items():
        if expected is None:  # unused: no gradient either way
            assert once[name] is None, name
            continue
        assert once[name].dtype == torch.float32
        torch.testing.assert_close(once[name], expected, rtol=rtol, atol=rtol * expected.abs().max().item())
