"""Pipeline parallel: stage planning and placement, the config checks, stage init, and parity with one process.

The parity runs build and train the model with the trainer's own code (``tests/parity.py``:
``core.build.build_model_parts`` -> ``build_pipeline``: split the meta model, ``parallelize_llama`` each stage,
``materialize_and_init``, PipelineStage + schedule; ``core.step.PipelineStep``) and train the debug model
(4 layers, fp32) for 10 AdamW steps on a fixed global batch per step, clipping over all stages. The reference is
the same recipe on one process without pipelining. Two spawned jobs run all multi-process checks, so processes
start and compilations happen once per job: 2 ranks (pp2 with every schedule eager, 1F1B and ZBVZeroBubble
compiled, and the real Trainer with gradient accumulation) and 4 ranks (dp_shard2 x pp2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import parity
from tests.distributed_utils import run_worlds_side_by_side

# With dp sharding the gradient norm is summed in another order: fp32 vector_norm of the 512k-entry output
# gradient on CPU is itself 5e-5 away from its fp64 value, so the reference norm is only that good
# (SHARDED_NORM_RTOL).
from tests.parity import (
    COMPILED_RTOL,
    EAGER_RTOL,
    SHARDED_NORM_RTOL,
    Recipe,
    build_layout,
    max_rel_diff,
    train_steps,
)
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import build_model
from titan_simple.parallel.clip_grad import clip_grad_norm_
from titan_simple.parallel.pipeline import PipelinePlan, plan_pipeline, split_stage
from titan_simple.parallel.sharded_init import materialize_and_init
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.trainer import Trainer

FLAVOR = "debugmodel"
N_LAYERS = 6  # the planning checks' model
PARITY_LAYERS = 4  # the parity runs' model: the fewest blocks that give pp2's 2-stage-per-rank schedules a block each
SEQ_LEN = 64
GLOBAL_BATCH = 8  # sequences per step: 4 microbatches on every pp rank (microbatch 2 without dp, 1 with dp2)
STEPS = 10
LR = 3e-3
MAX_NORM = 0.5  # below the first steps' gradient norms (~0.74): clipping scales them
VOCAB = 2000
DEVICE = torch.device("cpu")

# Measured largest relative differences from the reference over 10 steps (losses and grad norms): see the
# reply/README; these bounds leave some head room.
GRAD_RTOL = 1e-6  # max |grad - reference| over the largest reference gradient entry, first step

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


def job_config(*overrides: str):
    return load_job_config(
        [
            f"--model.flavor={FLAVOR}",
            f"--training.seq_len={SEQ_LEN}",
            "--training.mixed_precision_param=float32",
            "--training.mixed_precision_reduce=float32",
            f"--optimizer.lr={LR}",
            f"--training.max_norm={MAX_NORM}",
            *overrides,
        ]
    )


def pp_config(pp: int = 2, schedule: str = "1F1B", local_batch: int = 8, microbatch: int = 1, *extra: str):
    return job_config(
        f"--parallelism.pipeline_parallel_degree={pp}",
        f"--parallelism.pipeline_parallel_schedule={schedule}",
        f"--training.local_batch_size={local_batch}",
        f"--parallelism.pipeline_parallel_microbatch_size={microbatch}",
        *extra,
    )


# ---------------------------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("schedule", "stages"),
    [
        ("GPipe", ((0, 1, 2), (3, 4, 5))),
        ("1F1B", ((0, 1, 2), (3, 4, 5))),
        ("Interleaved1F1B", ((0, 1), (2, 3), (4,), (5,))),  # the earlier stages take the remainder
        ("LoopedBFS", ((0, 1), (2, 3), (4,), (5,))),
        ("InterleavedZeroBubble", ((0, 1), (2, 3), (4,), (5,))),
        ("ZBVZeroBubble", ((0, 1), (2, 3), (4,), (5,))),
    ],
)
def test_default_split_has_the_stages_the_schedule_runs(schedule, stages):
    plan = plan_pipeline(pp_config(2, schedule, 8, 2), N_LAYERS, 2)
    assert plan.stage_layers == stages
    assert plan.n_microbatches == 4


def test_explicit_splits():
    plan = plan_pipeline(pp_config(2, "1F1B", 4, 1, '--parallelism.pipeline_parallel_split_points=["layers.1"]'),
                         N_LAYERS, 2)
    assert plan.stage_layers == ((0,), (1, 2, 3, 4, 5))
    plan = plan_pipeline(
        pp_config(2, "LoopedBFS", 4, 1, '--parallelism.pipeline_parallel_split_points=["layers.1", "layers.2", '
                  '"layers.5"]'), N_LAYERS, 2)
    assert plan.stage_layers == ((0,), (1,), (2, 3, 4), (5,))
    plan = plan_pipeline(pp_config(2, "Interleaved1F1B", 4, 1, "--parallelism.pipeline_parallel_layers_per_stage=1"),
                         N_LAYERS, 2)
    assert plan.stage_layers == tuple((i,) for i in range(6))
    plan = plan_pipeline(pp_config(2, "LoopedBFS", 4, 1, "--parallelism.pipeline_parallel_layers_per_stage=2"),
                         8, 2)
    assert plan.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_placement_loop_and_v():
    loop = PipelinePlan("Interleaved1F1B", pp=2, stage_layers=((0,), (1,), (2,), (3,)), n_microbatches=4)
    assert [loop.stage_rank(s) for s in range(4)] == [0, 1, 0, 1]
    assert loop.stages_of_rank(0) == [0, 2] and loop.stages_of_rank(1) == [1, 3]
    v = PipelinePlan("ZBVZeroBubble", pp=4, stage_layers=tuple((i,) for i in range(8)), n_microbatches=8)
    assert [v.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of_rank(0) == [0, 7] and v.stages_of_rank(3) == [3, 4]
    # the same mapping as torch's own (the schedules compute it independently: both must agree)
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert generate_stage_to_rank_mapping(4, 8, style="v") == {s: v.stage_rank(s) for s in range(8)}
    assert generate_stage_to_rank_mapping(2, 4, style="loop") == {s: loop.stage_rank(s) for s in range(4)}


@pytest.mark.parametrize(
    ("pp", "schedule", "local_batch", "microbatch", "extra", "message"),
    [
        (4, "Interleaved1F1B", 8, 1, (), "needs 8 stages but the model has only 6 layers"),
        (2, "1F1B", 8, 1, ("--parallelism.pipeline_parallel_layers_per_stage=1",), "runs 1"),
        (2, "Interleaved1F1B", 8, 1, ("--parallelism.pipeline_parallel_layers_per_stage=3",), "runs several"),
        (2, "ZBVZeroBubble", 8, 1, ("--parallelism.pipeline_parallel_layers_per_stage=1",), "exactly 2"),
        (2, "1F1B", 8, 1, ("--parallelism.pipeline_parallel_layers_per_stage=2",), "not a multiple of"),
        (2, "1F1B", 8, 1, ('--parallelism.pipeline_parallel_split_points=["layers.6"]',), "is not a layer"),
        (2, "1F1B", 8, 1, ('--parallelism.pipeline_parallel_split_points=["layers.2"]',
                           "--parallelism.pipeline_parallel_layers_per_stage=3"), "both set"),
        (2, "1F1B", 2, 2, (), "1F1B needs at least as many microbatches as stages"),
        (2, "Interleaved1F1B", 5, 1, (), "use a multiple of 2"),
    ],
)
def test_impossible_pipelines_are_one_line_config_errors(pp, schedule, local_batch, microbatch, extra, message):
    with pytest.raises(ConfigError, match=message) as error:
        plan_pipeline(pp_config(pp, schedule, local_batch, microbatch, *extra), N_LAYERS, pp)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--parallelism.pipeline_parallel_microbatch_size=3",), "divisor of \\[training\\] local_batch_size = 8"),
        (("--parallelism.pipeline_parallel_microbatch_size=0",), "pipeline_parallel_microbatch_size = 0"),
        (('--parallelism.pipeline_parallel_split_points=["layers.3", "layers.2"]',), "strictly increasing"),
        (('--parallelism.pipeline_parallel_split_points=["output"]',), "strictly increasing"),
        (("--parallelism.pipeline_parallel_layers_per_stage=0",), "none or a positive integer"),
        (("--parallelism.pipeline_parallel_schedule=DualPipeV",), "not allowed"),
    ],
)
def test_config_rejects_bad_pipeline_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        job_config("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=8", *overrides)


def test_config_offers_exactly_the_supported_schedules():
    import dataclasses

    from titan_simple.config import Parallelism
    from titan_simple.parallel.pipeline import SCHEDULES as SUPPORTED

    field = next(f for f in dataclasses.fields(Parallelism) if f.name == "pipeline_parallel_schedule")
    assert field.metadata["choices"] == SUPPORTED == SCHEDULES


def test_trainer_checks_the_pipeline_before_any_process_group():
    config = pp_config(4, "Interleaved1F1B", 8, 1)
    with pytest.raises(ConfigError, match="only 6 layers"):
        Trainer(config, DistInfo(rank=0, world_size=4, local_rank=0, device=DEVICE))
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- split + init


def test_stages_keep_global_names_and_partition_the_model():
    whole = build_model(FLAVOR, max_seq_len=SEQ_LEN, device="meta")
    plan = plan_pipeline(pp_config(2, "ZBVZeroBubble", 8, 2), N_LAYERS, 2)
    parts = [split_stage(whole, plan, s) for s in range(plan.num_stages)]
    names = [set(dict(part.named_parameters())) for part in parts]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert sum(len(n) for n in names) == len(dict(whole.named_parameters()))  # disjoint
    assert list(parts[1].layers) == ["2", "3"] and "layers.2.attention.wq.weight" in names[1]
    assert parts[0].tok_embeddings is not None and parts[0].norm is None and parts[0].output is None
    assert all(p.tok_embeddings is None for p in parts[1:])
    assert parts[-1].norm is not None and parts[-1].output is not None
    assert whole.tok_embeddings is not None and len(whole.layers) == N_LAYERS  # the original is untouched


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_each_stage_initializes_to_the_whole_models_values(schedule):
    """Stage 1 lacks the embedding whose draws come first; per-parameter seeds make that irrelevant."""
    whole = build_model(FLAVOR, max_seq_len=SEQ_LEN, device="meta")
    reference = build_model(FLAVOR, max_seq_len=SEQ_LEN, device="meta")
    materialize_and_init(reference, DEVICE, seed=3)
    expected = dict(reference.named_parameters())
    plan = plan_pipeline(pp_config(2, schedule, 8, 2), N_LAYERS, 2)
    for stage in reversed(range(plan.num_stages)):  # order does not matter either
        part = split_stage(whole, plan, stage)
        materialize_and_init(part, DEVICE, seed=3)
        for name, param in part.named_parameters():
            assert torch.equal(param, expected[name]), (stage, name)
        torch.testing.assert_close(part.freqs_cis, reference.freqs_cis)
    # the init is the model's own: same statistics (std 1 embedding, depth-scaled output projections)
    assert expected["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert expected["layers.5.attention.wo.weight"].std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.05)
    assert not torch.equal(expected["layers.0.attention.wq.weight"], expected["layers.1.attention.wq.weight"])


def test_clip_without_pp_group_is_the_plain_global_norm():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.cat([p.grad.flatten() for p in params]).norm()
    grads = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 0.5, pp_group=None)
    torch.testing.assert_close(norm, expected)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * 0.5 / (expected + 1e-6))


# ---------------------------------------------------------------------------------------------- parity


RECIPE = Recipe(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, steps=STEPS, lr=LR, max_norm=MAX_NORM,
                extra=(f"--model.n_layers={PARITY_LAYERS}",))


def parity_config(*overrides: str):
    """``job_config`` with the parity runs' model (what ``RECIPE``'s reference trains)."""
    return job_config(f"--model.n_layers={PARITY_LAYERS}", *overrides)


def train_reference() -> dict:
    """One process, no pipeline: the trainer's step on the whole global batch."""
    return parity.train_reference(RECIPE)


def train_pipelined(config, world_size: int, keep_grads: bool) -> dict:
    layout = build_layout(config, world_size)
    out = train_steps(layout, RECIPE, keep_grads=keep_grads)
    out["stages"] = [stage.stage_index for stage in layout.parts.pipeline.stages]
    return out


def run_trainer(rank: int, world_size: int, dump: str, *overrides: str) -> list[float]:
    config = load_job_config(["--config", "llama3_debug.toml", "--training.steps", "4", "--training.seq_len", "64",
                              "--model.n_layers", str(PARITY_LAYERS),
                              "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0.5",
                              "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump,
                              "--training.mixed_precision_param", "float32", *overrides])  # fp32: parity to 1e-5
    return Trainer(config, DistInfo(rank, world_size, rank, DEVICE)).train()


TRAINER_PP = ("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
              "--training.global_batch_size", "8")  # 2 accumulation steps of 4 microbatches
TRAINER_REFERENCE = ("--training.local_batch_size", "8",)


def _run_configs(rank: int, world_size: int, configs: dict, dump: str | None = None) -> dict:
    torch.manual_seed(0)
    results = {}
    for name, (overrides, keep_grads) in configs.items():
        results[name] = train_pipelined(parity_config(*overrides), world_size, keep_grads)
    if dump is not None:  # the real trainer: rank 0 (first stage) must log the last stage's loss
        results["trainer"] = run_trainer(rank, world_size, dump, *TRAINER_PP)
    return results


def pp2(schedule: str, *extra: str) -> tuple[str, ...]:
    return ("--parallelism.pipeline_parallel_degree=2", f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--training.local_batch_size={GLOBAL_BATCH}", "--parallelism.pipeline_parallel_microbatch_size=2",
            *extra)


def dp2_pp2(schedule: str, *extra: str) -> tuple[str, ...]:
    return ("--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--training.local_batch_size={GLOBAL_BATCH // 2}", "--parallelism.pipeline_parallel_microbatch_size=1",
            *extra)


COMPILE = ("--compile.enable",)
TWO_RANK_CONFIGS = {
    **{f"{schedule}/eager": (pp2(schedule), True) for schedule in SCHEDULES},
    "1F1B/compiled": (pp2("1F1B", *COMPILE), False),
    "ZBVZeroBubble/compiled": (pp2("ZBVZeroBubble", *COMPILE), True),
}
FOUR_RANK_CONFIGS = {
    "1F1B/eager": (dp2_pp2("1F1B"), True),
    "ZBVZeroBubble/eager": (dp2_pp2("ZBVZeroBubble"), False),
    "Interleaved1F1B/compiled": (dp2_pp2("Interleaved1F1B", *COMPILE), False),
    "fsdp2/1F1B/eager": (dp2_pp2("1F1B", "--parallelism.fsdp_implementation=fsdp2"), True),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> list[list[dict]]:
    """The 2- and the 4-rank jobs side by side: a stage's ranks wait for each other's sends, and the other world's
    work uses those cores."""
    dump = str(tmp_path_factory.mktemp("pp_trainer"))
    return run_worlds_side_by_side([(_run_configs, 2, (TWO_RANK_CONFIGS, dump)),
                                    (_run_configs, 4, (FOUR_RANK_CONFIGS,))])


@pytest.fixture(scope="module")
def two_ranks(worlds) -> list[dict]:
    return worlds[0]


@pytest.fixture(scope="module")
def four_ranks(worlds) -> list[dict]:
    return worlds[1]


def assert_parity(results: list[dict], key: str, reference: dict, rtol: float, norm_rtol: float | None = None) -> None:
    parity.assert_parity(results, key, reference, rtol, norm_rtol=norm_rtol, grad_rtol=GRAD_RTOL)


def test_reference_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["norms"][0] > MAX_NORM  # clipping is active: the pp ranks must agree on the norm


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_every_schedule_eager(two_ranks, reference, schedule):
    assert_parity(two_ranks, f"{schedule}/eager", reference, EAGER_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_pp2_compiled(two_ranks, reference, schedule):
    assert_parity(two_ranks, f"{schedule}/compiled", reference, COMPILED_RTOL)


@pytest.mark.slow
def test_stage_placement_on_ranks(two_ranks):
    assert [r["1F1B/eager"]["stages"] for r in two_ranks] == [[0], [1]]
    assert [r["Interleaved1F1B/eager"]["stages"] for r in two_ranks] == [[0, 2], [1, 3]]
    assert [r["ZBVZeroBubble/eager"]["stages"] for r in two_ranks] == [[0, 3], [1, 2]]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FOUR_RANK_CONFIGS))
def test_dp_shard2_x_pp2(four_ranks, reference, key):
    rtol = COMPILED_RTOL if key.endswith("compiled") else EAGER_RTOL
    assert_parity(four_ranks, key, reference, rtol, norm_rtol=SHARDED_NORM_RTOL)
    grad_types = four_ranks[0][key].get("grad_types")
    assert grad_types in (None, {"DTensor"})  # SimpleFSDP shards every stage's parameters


@pytest.mark.slow
def test_trainer_logs_the_last_stages_loss(two_ranks, tmp_path):
    """Trainer with pp2 (1F1B; rank 0 holds the first stage) and 2 accumulation steps: the same losses on every
    rank as one process with the whole batch at once."""
    expected = run_trainer(0, 1, str(tmp_path), *TRAINER_REFERENCE)
    for rank_result in two_ranks:
        assert max_rel_diff(rank_result["trainer"], expected) <= 1e-5, (rank_result["trainer"], expected)
