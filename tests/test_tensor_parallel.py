"""Tensor parallel (with sequence and loss parallel) on the real Llama 3 debug model: the same losses as
one process, alone and composed with SimpleFSDP, eager and compiled, under every activation-checkpointing
mode; the layout of its parameters and gradients; its checks against the model.

Every layout is built and trained by the trainer's own code through ``tests/parity.py``
(``core.build.build_model_parts``: meta device -> ``parallelize_llama`` -> ``materialize_and_init``, whose
``layout_invariant_init`` draws each whole parameter from its own seed; ``core.step``'s step object: the summed
cross-entropy under ``loss_parallel_context`` when the logits are vocab-sharded, over the global token count,
clipping, AdamW). Each data-parallel rank trains on its slice (along the batch dim) of one fixed global batch per
step, and all TP ranks of a dp group read the same slice. The single-process reference is the same recipe with
world size 1, computed once in the test process.

Two spawned jobs run all the multi-process cases, so processes start and compilation happens once per job:
2 ranks (tp2, with and without loss parallel) and 4 ranks (dp_shard2 x tp2: eager, compiled with transformer_block,
regionally compiled (aot_eager), AC full / selective, FSDP2 instead of SimpleFSDP; plus the weights and
placements after training). The model has 2 blocks: every block is the same code, and compile time grows with them.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.distributed_utils import run_on_ranks
from tests.parity import SHARDED_NORM_RTOL, Recipe, build_layout, full_tensor, max_rel_diff, train_steps
from tests.parity import assert_parity as check_parity
from titan_simple.core.plan import uses_loss_parallel
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import LLAMA3_FLAVORS
from titan_simple.parallel.dims import ParallelDims, validate_parallelism
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.trainer import Trainer

FLAVOR = "debugmodel"
SEQ_LEN = 64
GLOBAL_BATCH = 4  # sequences per step; dp2 ranks take 2 each, TP ranks of one dp group the same 2
STEPS = 10
AC_STEPS = 3  # enough to show AC changes nothing: steps 2 and 3 depend on the recomputed backward
LR = 3e-3
MAX_NORM = 1.0
VOCAB = 2000
DEVICE = torch.device("cpu")

# Measured on 2 CPU cores, torch 2.13 (largest relative difference from the reference over the steps; run
# with -s to see them; 2 blocks, 2026-11-26): losses 1.2e-7 (tp2, dp2 x tp2 eager / compiled / auto / AC), gradient
# norms 6.0e-5, weights after 10 steps 3.8e-6 of the largest weight. Gradient norms differ more than losses: torch's
# fp32 CPU norm of the 512k-entry output-projection gradient is itself ~3e-5 off its fp64 value, and the TP ranks
# take it in two halves (6 blocks, step 1: fp64 1.0435406; reference 1.0434747; tp2 1.0435150), while the
# gradients agree to 1e-6.
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 5e-5  # Adam amplifies tiny gradient differences of near-zero gradient entries


N_LAYERS = 2  # every block is the same code; two keep the compiled layouts' compile time down
RECIPE = Recipe(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, steps=STEPS, lr=LR, max_norm=MAX_NORM, batch_seed=4321,
                extra=(f"--model.n_layers={N_LAYERS}",))


def job_config(*overrides: str):
    return RECIPE.config(*overrides)


def full_state(model) -> dict[str, torch.Tensor]:
    """Unsharded copies of the parameters (``full_tensor()`` is a collective: every rank must call it; of a
    replicated DTensor it returns the local tensor itself, hence the clone)."""
    return {name: full_tensor(value) for name, value in model.state_dict().items()}


def train(config, world_size: int = 1, steps: int = STEPS, inspect: bool = False) -> dict:
    """``steps`` steps of the trainer's own step; every rank returns the global losses."""
    layout = build_layout(config, world_size)
    model = layout.parts.model
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    init = full_state(model) if inspect else None  # on every rank: full_tensor() is a collective
    logits_types: list = []

    def record_logits_type(_module, _inputs, logits) -> None:
        logits_types.append((type(logits).__name__, tuple(getattr(logits, "placements", ()))))
        hook.remove()  # the first step's only

    # Not on a compiled model: Dynamo would trace the hook and guard on the list.
    hook = model.register_forward_hook(record_logits_type) if not config.compile.enable else None

    def grad_layouts(out: dict) -> None:
        if inspect:
            out["grad_layouts_match"] = all(
                isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in model.parameters()
            )

    out = train_steps(layout, RECIPE, steps=steps, after_first_backward=grad_layouts)
    if config.compile.enable:
        out["dp_collectives"] = dp_collective_counts(layout)
    if logits_types:
        out["logits_type"] = logits_types[0]
    if inspect:
        out["init"] = init if rank0 else None
        state = model.state_dict()
        out["state_types"] = {type(v).__name__ for v in state.values()}
        out["placements"] = {k: tuple(v.placements) for k, v in state.items() if isinstance(v, DTensor)}
        out["freqs_cis_type"] = type(model.freqs_cis).__name__
        final = full_state(model)
        out["final"] = final if rank0 else None
    return out


def dp_collective_counts(layout) -> dict[str, int]:
    """How many collectives the compiled code issues on the dp_shard group, per graph and kind
    (``"forward/all_gather"``), from the comm plan compile recorded."""
    group = layout.mesh["dp_shard"].get_group().group_name
    counts: collections.Counter = collections.Counter()
    for recorder in layout.parts.comm_plan_recorders:
        for graph, collectives in recorder.graphs.items():
            counts.update(f"{graph}/{c['kind']}" for c in collectives if c["group"] == group)
    return dict(counts)


def _run_configs(rank: int, world_size: int, configs: dict) -> dict:
    results = {}
    for name, (overrides, steps, inspect) in configs.items():
        start = time.perf_counter()
        result = train(job_config(*overrides), world_size, steps=steps, inspect=inspect)
        result["seconds"] = time.perf_counter() - start
        if rank != 0:  # only rank 0 returns the weights: less to pickle
            result = {k: v for k, v in result.items() if k not in ("init", "final")}
        results[name] = result
    return results


TP2 = ("--parallelism.tensor_parallel_degree=2",)
DP2_TP2 = ("--parallelism.data_parallel_shard_degree=2", *TP2)
TWO_RANK_CONFIGS = {
    "tp2/loss_parallel": (TP2, STEPS, True),
    "tp2/no_loss_parallel": ((*TP2, "--parallelism.disable_loss_parallel"), STEPS, False),
}
FOUR_RANK_CONFIGS = {
    "dp2_tp2/eager": (DP2_TP2, STEPS, True),
    "dp2_tp2/compiled": ((*DP2_TP2, "--compile.enable"), STEPS, False),
    # aot_eager: the regions' hand-off is Dynamo's and AOTAutograd's; Inductor's passes over regions run in
    # tests/test_regional_compile.py.
    "dp2_tp2/regional": ((*DP2_TP2, "--compile.enable", "--compile.backend=aot_eager", "--compile.regional",
                          "--compile.regional_blocks=1"), AC_STEPS, False),
    "dp2_tp2/ac_full": ((*DP2_TP2, "--activation_checkpoint.mode=full"), AC_STEPS, False),
    "dp2_tp2/ac_selective": ((*DP2_TP2, "--activation_checkpoint.mode=selective"), AC_STEPS, False),
    "dp2_tp2/fsdp2": ((*DP2_TP2, "--parallelism.fsdp_implementation=fsdp2"), AC_STEPS, True),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(job_config(), world_size=1, inspect=True)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_run_configs, 2, args=(TWO_RANK_CONFIGS,))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    dump = f"--job.dump_folder={tmp_path_factory.mktemp('tp_dump')}"  # the compiled run writes its comm plan
    configs = {name: ((*args, dump), steps, inspect) for name, (args, steps, inspect) in FOUR_RANK_CONFIGS.items()}
    return run_on_ranks(_run_configs, 4, args=(configs,))


def assert_parity(results: list[dict], key: str, reference: dict) -> None:
    for rank, rank_results in enumerate(results):  # -s shows the measured differences
        run = rank_results[key]
        steps = len(run["losses"])
        print(f"{key} rank {rank}: losses {max_rel_diff(run['losses'], reference['losses'][:steps]):.1e}, "
              f"norms {max_rel_diff(run['norms'], reference['norms'][:steps]):.1e}, {run['seconds']:.0f} s")
    check_parity(results, key, reference, LOSS_RTOL, norm_rtol=SHARDED_NORM_RTOL)


def max_weight_diff(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over the largest |weight|: relative to the model's scale, not per entry."""
    assert state.keys() == expected.keys()
    scale = max(v.abs().max().item() for v in expected.values())
    return max((state[k] - v).abs().max().item() for k, v in expected.items()) / scale


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.slow
def test_reference_trains(reference):
    assert len(reference["losses"]) == STEPS
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["logits_type"] == ("Tensor", ())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["loss_parallel", "no_loss_parallel"])
def test_tp2_matches_single_process(two_ranks, reference, variant):
    assert_parity(two_ranks, f"tp2/{variant}", reference)


@pytest.mark.slow
def test_loss_parallel_keeps_logits_vocab_sharded(two_ranks):
    assert two_ranks[0]["tp2/loss_parallel"]["logits_type"] == ("DTensor", (Shard(2),))
    assert two_ranks[0]["tp2/no_loss_parallel"]["logits_type"] == ("Tensor", ())


@pytest.mark.slow
def test_tp_alone_init_layouts_and_state_dict(two_ranks, reference):
    run = two_ranks[0]["tp2/loss_parallel"]
    assert max_weight_diff(run["init"], reference["init"]) == 0.0  # layout-invariant init: bitwise
    assert run["grad_layouts_match"]  # no Partial norm gradients, no Replicate embedding gradient
    assert run["state_types"] == {"DTensor"}
    assert run["freqs_cis_type"] == "Tensor"  # the RoPE buffer stays a plain tensor
    placements = run["placements"]
    assert placements["tok_embeddings.weight"] == (Shard(0),)  # vocab rows
    assert placements["layers.0.attention.wq.weight"] == (Shard(0),)
    assert placements["layers.0.attention.wo.weight"] == (Shard(1),)
    assert placements["layers.0.feed_forward.w2.weight"] == (Shard(1),)
    assert placements["layers.0.attention_norm.weight"] == (Replicate(),)
    assert placements["output.weight"] == (Shard(0),)
    final_diff = max_weight_diff(run["final"], reference["final"])
    print(f"weights after {STEPS} steps: {final_diff:.1e} of the largest weight")
    assert final_diff <= WEIGHT_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eager", "compiled"])
def test_dp2_tp2_matches_single_process(four_ranks, reference, variant):
    assert_parity(four_ranks, f"dp2_tp2/{variant}", reference)
    if variant == "compiled":
        run = four_ranks[0]["dp2_tp2/compiled"]
        assert run["graph_breaks"] == {} and run["unique_graphs"] == 1


@pytest.mark.slow
def test_bucketing_on_dp2_tp2_buckets_the_dp_collectives(four_ranks):
    """Unbucketed, SimpleFSDP issues one dp all-gather per parameter in forward and one dp reduce-scatter per
    parameter in backward. transformer_block (the default, compiled above) issues one per block bucket, both ways
    (Inductor's auto bucketing is counted in tests/test_compile.py)."""
    n_buckets = 1 + N_LAYERS + 1  # tok_embeddings, each block, norm + output
    per_block = four_ranks[0]["dp2_tp2/compiled"]["dp_collectives"]
    print(f"dp collectives: transformer_block {per_block}")
    assert per_block["forward/all_gather"] == n_buckets and per_block["backward/reduce_scatter"] == n_buckets


@pytest.mark.slow
def test_dp2_tp2_compiles_regionally(four_ranks, reference):
    """Regional compilation under tensor parallel: the embedding's layouts are forward hooks, so its region runs
    eagerly and hands nothing on; the first block region gathers its own first weights and hands the next
    region (here the last: 2 blocks, 1 per region) its own. Two compiled codes."""
    assert_parity(four_ranks, "dp2_tp2/regional", reference)
    run = four_ranks[0]["dp2_tp2/regional"]
    assert run["graph_breaks"] == {} and run["unique_graphs"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_nothing_on_dp2_tp2(four_ranks, reference, mode):
    assert_parity(four_ranks, f"dp2_tp2/ac_{mode}", reference)
    eager = four_ranks[0]["dp2_tp2/eager"]["losses"][:AC_STEPS]
    assert max_rel_diff(four_ranks[0][f"dp2_tp2/ac_{mode}"]["losses"], eager) <= LOSS_RTOL


@pytest.mark.slow
def test_fsdp2_composes_with_tp(four_ranks, reference):
    assert_parity(four_ranks, "dp2_tp2/fsdp2", reference)
    run = four_ranks[0]["dp2_tp2/fsdp2"]
    assert run["grad_layouts_match"] and run["state_types"] == {"DTensor"}
    assert run["placements"]["layers.0.attention.wq.weight"] == (_StridedShard(0, split_factor=2), Shard(0))


@pytest.mark.slow
def test_dp2_tp2_state_dict_holds_the_single_process_weights(four_ranks, reference):
    run = four_ranks[0]["dp2_tp2/eager"]
    # Layout-invariant init through _StridedShard (dp) x Shard (tp) placements: bitwise the reference init.
    assert max_weight_diff(run["init"], reference["init"]) == 0.0
    assert run["state_types"] == {"DTensor"} and run["freqs_cis_type"] == "Tensor"
    assert run["grad_layouts_match"]
    placements = run["placements"]
    assert placements["layers.0.attention.wq.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["layers.0.attention.wo.weight"] == (Shard(0), Shard(1))
    assert placements["layers.0.attention_norm.weight"] == (Shard(0), Replicate())
    final_diff = max_weight_diff(run["final"], reference["final"])
    print(f"weights after {STEPS} steps: {final_diff:.1e} of the largest weight")
    assert final_diff <= WEIGHT_RTOL


# ---------------------------------------------------------------------------------------------- checks


def _dims(tp: int, world_size: int | None = None) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=-1, tp=tp, pp=1, world_size=world_size or tp)


@pytest.mark.parametrize(
    ("tp", "message"),
    [(3, "does not divide n_heads = 16"), (16, "does not divide n_kv_heads = 8")],
)
def test_heads_must_divide_by_tp(tp, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate_parallelism(_dims(tp), LLAMA3_FLAVORS[FLAVOR], job_config())
    assert "tensor_parallel_degree" in str(error.value) and "use one of 1, 2, 4, 8" in str(error.value)


def test_seq_len_must_divide_by_tp():
    with pytest.raises(ConfigError, match=r"\[training\] seq_len = 66 is not a multiple of .* = 4.*use e.g. 68"):
        validate_parallelism(_dims(4), LLAMA3_FLAVORS[FLAVOR], job_config("--training.seq_len=66"))
    validate_parallelism(_dims(4), LLAMA3_FLAVORS[FLAVOR], job_config("--training.seq_len=68"))
    validate_parallelism(_dims(1), LLAMA3_FLAVORS[FLAVOR], job_config("--training.seq_len=67"))


def test_trainer_rejects_bad_tp_before_any_process_group():
    config = job_config("--parallelism.tensor_parallel_degree=3")
    info = DistInfo(rank=0, world_size=3, local_rank=0, device=DEVICE)  # no peers exist: a PG would hang
    with pytest.raises(ConfigError, match="n_heads"):
        Trainer(config, info)
    assert not dist.is_initialized()


def test_disable_loss_parallel_option():
    assert job_config().parallelism.disable_loss_parallel is False
    config = job_config("--parallelism.disable_loss_parallel", *TP2)
    assert config.parallelism.disable_loss_parallel is True
    assert not uses_loss_parallel(config, _dims(2))
    assert uses_loss_parallel(job_config(*TP2), _dims(2))
    assert not uses_loss_parallel(job_config(), _dims(1))
