"""Tied embeddings (Llama 3.2's ``tie_word_embeddings``): one parameter that is both the token embedding and the
output projection, through SimpleFSDP, tensor parallel (loss parallel), gathering once per step, compile,
checkpoints (exact resume, resharding), and refused under pipeline parallel.

The model is ``debugmodel_tied`` (the debug model with Llama 3.2's tying and factor-32 RoPE) cut to 2 blocks; the
recipe and tolerances are the suite's parity ones (``tests/parity.py``): fp32, 6 AdamW steps with clipping active,
a fixed global batch of 4 x 64 random tokens per step.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from tests import parity
from tests.distributed_utils import run_on_ranks
from tests.harness import FP32
from tests.parity import COMPILED_RTOL, EAGER_RTOL, SHARDED_NORM_RTOL, Recipe, assert_parity, build_layout
from tests.test_checkpoint import assert_same_weights, full_weights, make_trainer, stop_with_sigterm_after
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import build_model, count_parameters
from titan_simple.models.rope import LLAMA32_ROPE
from titan_simple.parallel.simple_fsdp import sharded_parameters
from titan_simple.trainer.checkpoint import complete_steps, read_marker
from titan_simple.trainer.distributed import DistInfo

RECIPE = Recipe(flavor="debugmodel_tied", steps=6, extra=("--model.n_layers=2",))
TIED = ["--model.flavor", "debugmodel_tied", "--model.n_layers", "2"]


def _layout(dp: int = 1, tp: int = 1, *extra: str) -> tuple[str, ...]:
    return (f"--parallelism.data_parallel_shard_degree={dp}", f"--parallelism.tensor_parallel_degree={tp}",
            f"--training.local_batch_size={RECIPE.global_batch // dp}", *extra)


TWO_RANK_CONFIGS = {
    "fully_shard2/compiled": _layout(2, 1, "--compile.enable"),
    "fully_shard2/eager": _layout(2),
    "fully_shard2_fsdp2/eager": _layout(2, 1, "--parallelism.fsdp_implementation=fsdp2"),
    # Two accumulation steps of 1 row per rank, the weights gathered once for both (parallel/fsdp_gather.py).
    "fully_shard2_once_per_step/eager": _layout(2, 1, "--training.local_batch_size=1",
                                                "--parallelism.fsdp_gather=once_per_step"),
    "tp2/eager": _layout(tp=2),
}
FOUR_RANK_CONFIGS = {"dp2_tp2/eager": _layout(2, 2)}


def _tied_everywhere(layout: parity.Run) -> bool:
    model = layout.parts.model
    return model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]


def _train(rank: int, world_size: int, configs: dict[str, tuple[str, ...]]) -> dict:
    results = {}
    for name, args in configs.items():
        layout = build_layout(RECIPE.config(*args), world_size)
        results[name] = parity.train_steps(layout, RECIPE, keep_grads=True)
        results[name]["tied"] = _tied_everywhere(layout)
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    return parity.train_reference(RECIPE)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_train, 2, args=(TWO_RANK_CONFIGS,))


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_train, 4, args=(FOUR_RANK_CONFIGS,))


def test_tied_flavor_is_llama32_shaped_and_counts_the_shared_weight_once():
    model = build_model("debugmodel_tied", device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert model.args.rope_scaling == LLAMA32_ROPE
    untied = build_model("debugmodel", device="cpu")
    shared = 2000 * 256
    assert count_parameters(model) == count_parameters(untied) - shared
    # FLOPs count the output projection's matmul: the tied weight is excluded as the embedding, kept as the output.
    assert count_parameters(model, exclude_embedding=True) == count_parameters(untied, exclude_embedding=True)
    model.to_empty(device="cpu")  # gives each module its own tensor: the model ties them again
    assert model.output.weight is model.tok_embeddings.weight


def test_reference_learns_and_clips(reference):
    assert reference["norms"][0] > RECIPE.max_norm
    assert reference["losses"][-1] < reference["losses"][0]
    assert set(reference["grads"]) >= {"tok_embeddings.weight"} and "output.weight" not in reference["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(TWO_RANK_CONFIGS))
def test_tied_model_on_two_processes_matches_one_process(two_ranks, reference, key):
    rtol = COMPILED_RTOL if "compiled" in key else EAGER_RTOL
    assert_parity(two_ranks, key, reference, rtol, norm_rtol=SHARDED_NORM_RTOL, grad_rtol=1e-5)
    assert all(rank[key]["tied"] for rank in two_ranks)


@pytest.mark.slow
def test_tied_model_on_dp2_tp2_matches_one_process(four_ranks, reference):
    assert_parity(four_ranks, "dp2_tp2/eager", reference, EAGER_RTOL, norm_rtol=SHARDED_NORM_RTOL, grad_rtol=1e-5)
    assert all(rank["dp2_tp2/eager"]["tied"] for rank in four_ranks)


def test_tied_model_under_pipeline_parallel_is_one_error_line():
    config = load_job_config([*TIED, "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match=r"ties its output projection .* pipeline parallel") as error:
        resolve_plan(config, 2, "cpu")
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------ checkpoints


def test_tied_resume_is_exact_and_hf_round_trip_is_bitwise(tmp_path):
    uninterrupted = make_trainer(tmp_path / "full", *TIED, steps=4).train()
    first = make_trainer(tmp_path / "run", *TIED, "--checkpoint.enable", "--checkpoint.interval", "100",
                         "--checkpoint.last_save_in_hf", steps=4)
    stop_with_sigterm_after(first, 2)
    assert len(first.train()) == 2
    resumed = make_trainer(tmp_path / "run", *TIED, "--checkpoint.enable", "--checkpoint.interval", "100",
                           "--checkpoint.last_save_in_hf", steps=4)
    assert resumed.global_step == 2
    model = resumed.run.parts.model
    assert model.output.weight is model.tok_embeddings.weight
    assert resumed.train() == uninterrupted[2:]  # bitwise

    hf = tmp_path / "run" / "checkpoint" / "step-4" / "hf"
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    from_hf = make_trainer(tmp_path / "from_hf", *TIED, "--checkpoint.initial_load_path", str(hf), steps=1)
    from_dcp = make_trainer(tmp_path / "from_dcp", *TIED, "--checkpoint.initial_load_path",
                            str(hf.parent), steps=1)
    assert_same_weights(full_weights(from_hf), full_weights(from_dcp))
    assert from_hf.run.parts.model.output.weight is from_hf.run.parts.model.tok_embeddings.weight
    assert from_hf.train() == from_dcp.train()


def test_untied_checkpoint_into_tied_model_is_refused(tmp_path):
    make_trainer(tmp_path, "--model.n_layers", "2", "--checkpoint.enable", "--checkpoint.interval", "1",
                 steps=1).train()
    step = tmp_path / "checkpoint" / "step-1"
    with pytest.raises(ConfigError, match=r"tie_word_embeddings False \(this run: True\)") as error:
        make_trainer(tmp_path / "tied", *TIED, "--model.rope_scaling", "none",
                     "--checkpoint.initial_load_path", str(step), steps=1)
    assert "\n" not in str(error.value)
    # The fix is the saved model's settings (complete.json), not initial_load_path, which is what was run.
    assert str(error.value).endswith("build the model it was saved by: --model.flavor debugmodel and drop "
                                     "--model.rope_scaling none."), error.value
    assert "initial_load_path" not in str(error.value)


def test_tied_checkpoint_into_untied_model_names_the_tied_flavor_not_initial_load_path(tmp_path):
    make_trainer(tmp_path, *TIED, "--checkpoint.enable", steps=1).train()
    step = tmp_path / "checkpoint" / "step-1"
    with pytest.raises(ConfigError) as error:
        make_trainer(tmp_path / "untied", "--model.n_layers", "2", "--checkpoint.initial_load_path", str(step),
                     steps=1)
    message = str(error.value)
    assert "\n" not in message and "tie_word_embeddings True (this run: False)" in message, message
    assert message.endswith("Tying cannot change on load (a tied model has one weight for the embedding and the "
                            "output projection); build the model it was saved by: --model.flavor debugmodel_tied."), \
        message


def _train_on_ranks(rank: int, world_size: int, dump: str, extra: list[str], steps: int) -> dict:
    torch.set_num_threads(1)
    trainer = make_trainer(Path(dump), *TIED, *extra, steps=steps,
                           dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")))
    model = trainer.run.parts.model
    with sharded_parameters():
        tied = model.output.weight is model.tok_embeddings.weight
        placements = tuple(model.tok_embeddings.weight.placements)
    losses = trainer.train()
    return {"losses": losses, "start_step": trainer.global_step - len(losses), "tied": tied,
            "placements": str(placements)}


@pytest.mark.slow
def test_tied_checkpoint_reshards_from_fully_shard_to_tensor_parallel(tmp_path):
    """4 steps of fully_shard on 2 ranks saving every 2; step 2 resumed under tensor parallel on 2 ranks (the same
    global batch: local 4 on one dp rank instead of 2 on two) continues with the losses of the uninterrupted run (to
    the parity tolerance: another layout adds in another order)."""
    saved = run_on_ranks(_train_on_ranks, 2, args=(str(tmp_path / "fsdp"), [
        *FP32, "--checkpoint.enable", "--checkpoint.interval", "2"], 4))
    assert complete_steps(tmp_path / "fsdp" / "checkpoint") == [2, 4]
    step_2 = tmp_path / "fsdp" / "checkpoint" / "step-2"
    assert read_marker(step_2)["model_args"]["tie_word_embeddings"] is True
    shutil.copytree(step_2, tmp_path / "tp" / "checkpoint" / "step-2")
    resumed = run_on_ranks(_train_on_ranks, 2, args=(str(tmp_path / "tp"), [
        *FP32, "--checkpoint.enable", "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
        4))
    assert resumed[0]["start_step"] == 2 and resumed[0]["tied"]
    assert "Shard(dim=0)" in resumed[0]["placements"]  # the vocabulary split over the two TP ranks
    continued, uninterrupted = resumed[0]["losses"], saved[0]["losses"][2:]
    assert len(continued) == 2
    assert parity.max_rel_diff(continued, uninterrupted) <= EAGER_RTOL, (continued, uninterrupted)


def test_tied_weight_keeps_its_name_once_in_the_optimizer_and_the_model_state():
    model = build_model("debugmodel_tied", device="cpu", n_layers=1)
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    state = model.state_dict()
    assert state["output.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()
    assert dataclasses.asdict(model.args)["rope_scaling"]["factor"] == 32.0
