"""Validation: the loss the Validator reports is the plain cross-entropy of the held-out batches, on one process
and on every parallel layout (the same model evaluated on the same batches gives the same number)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.tensor import DTensor

from tests.distributed_utils import run_on_ranks
from tests.harness import read_metrics
from titan_simple.config import load_job_config
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.datasets import shakespeare_files
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import build_model
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.metrics import StepTimer
from titan_simple.trainer.trainer import Trainer

SEQ_LEN = 64
LOCAL_BATCH = 2
VALIDATION_STEPS = 2
TINY = ["--config", "llama3_debug.toml", "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size",
        str(LOCAL_BATCH), "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0.5",
        "--validation.enable", "--validation.steps", str(VALIDATION_STEPS),
        "--training.mixed_precision_param", "float32"]  # fp32 on every CPU: the comparisons are at fp32 precision


def tiny_config(dump: str, *extra: str):
    return load_job_config([*TINY, "--job.dump_folder", dump, *extra])


def held_out_batches(config, dp_rank: int, dp_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``count`` validation batches of one data-parallel rank, read independently of the Validator."""
    loader = build_dataloader(
        dataset="shakespeare", dataset_path=None, tokenizer=Tokenizer(config.model.tokenizer_path), seq_len=SEQ_LEN,
        local_batch_size=LOCAL_BATCH, dp_rank=dp_rank, dp_world_size=dp_size, split="validation", infinite=False,
    )
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            return batches
    raise AssertionError("not enough held-out data for the test")


def hand_computed_loss(model: torch.nn.Module, batches) -> float:
    """Mean token cross-entropy, batch by batch (every batch has the same number of tokens)."""
    with torch.no_grad():
        means = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    return sum(means) / len(means)


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole model's parameters, on every rank (a collective: every rank must call it)."""
    state = {}
    for part in trainer.run.parts.modules:
        for name, param in part.named_parameters():
            state[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
    if trainer.run.parts.pipeline is not None:  # each pp rank holds its stages: gather them all
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, state)
        state = {k: v for rank_state in everyone for k, v in rank_state.items()}
    return state


def reference_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model("debugmodel", max_seq_len=SEQ_LEN, device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("freqs_cis" in name for name in missing), (missing, unexpected)
    return model


# ------------------------------------------------------------------------------------------- one process


def test_validation_loss_equals_hand_computed_loss_and_is_logged(tmp_path, caplog):
    trainer = Trainer(tiny_config(str(tmp_path), "--training.steps", "4", "--validation.freq", "2"))
    batches = held_out_batches(trainer.config, 0, 1, VALIDATION_STEPS)

    model = trainer.run.parts.model
    at_init = trainer.validator.validate()
    expected = hand_computed_loss(model, batches)
    assert at_init["validation_metrics/loss"] == pytest.approx(expected, rel=1e-6)
    assert abs(expected - math.log(2000)) < 0.5  # an untrained model is about uniform over the 2000 tokens
    assert at_init["validation_metrics/perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert trainer.validator.validate() == at_init  # each validation starts from the first held-out document

    with caplog.at_level(logging.INFO, logger="titan_simple"):
        trainer.train()
    after = trainer.validator.validate()
    assert after["validation_metrics/loss"] == pytest.approx(hand_computed_loss(model, batches), rel=1e-6)

    records = read_metrics(tmp_path)
    validation = [r for r in records if "validation_metrics/loss" in r]
    assert [r["step"] for r in validation] == [2, 4]
    assert validation[-1]["validation_metrics/loss"] == pytest.approx(after["validation_metrics/loss"], rel=1e-6)
    losses = [at_init["validation_metrics/loss"]] + [r["validation_metrics/loss"] for r in validation]
    assert losses[0] > losses[1] > losses[2]  # held-out loss falls while training
    for r in validation:
        assert r["validation_metrics/perplexity"] == pytest.approx(math.exp(r["validation_metrics/loss"]), rel=1e-9)
    assert any(m.getMessage().startswith("step 4/4 | validation loss ") for m in caplog.records)

    (run_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert {"validation_metrics/loss", "validation_metrics/perplexity"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("validation_metrics/loss")] == [2, 4]
    assert events.Scalars("validation_metrics/loss")[-1].value == pytest.approx(losses[-1], rel=1e-6)


def test_validation_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"\[validation\] seq_len = 128 is impossible"):
        tiny_config(str(tmp_path), "--validation.seq_len", "128")  # longer than the model's RoPE table
    with pytest.raises(ConfigError, match=r"\[validation\] freq = 0 is impossible"):
        tiny_config(str(tmp_path), "--validation.freq", "0")
    with pytest.raises(ConfigError, match=r"\[validation\] no held-out batch"):
        # 3000 sequences of 65 tokens per batch: more than the 159,726 tokens of the 4 held-out plays.
        trainer = Trainer(tiny_config(str(tmp_path), "--validation.local_batch_size", "3000"))
        trainer.validator.validate()
    with pytest.raises(ConfigError, match=r"^\[validation\] dataset = 'json' reads local files; set \[validation\] "
                                          r"dataset_path"):
        Trainer(tiny_config(str(tmp_path), "--validation.dataset", "json"))


def test_steps_minus_one_reads_all_of_a_local_held_out_file_once(tmp_path):
    held_out = tmp_path / "held_out.txt"  # one .txt file = one document
    held_out.write_text((shakespeare_files("validation")[1]).read_text()[:20_000])
    config = tiny_config(str(tmp_path), "--validation.steps", "-1", "--validation.dataset", "text",
                         "--validation.dataset_path", str(held_out))
    trainer = Trainer(config)
    metrics = trainer.validator.validate()
    tokens = len(trainer.tokenizer.encode(held_out.read_text(), bos=True, eos=True))
    assert trainer.validator.batches_last_run == tokens // (SEQ_LEN + 1) // LOCAL_BATCH > 10
    assert abs(metrics["validation_metrics/loss"] - math.log(2000)) < 0.5


# ------------------------------------------------------------------------------------------- layouts

LAYOUTS = {
    "simple_fsdp": ("--parallelism.data_parallel_shard_degree", "2"),
    "simple_fsdp_full_ac": ("--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full"),
    "fsdp2": ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_implementation", "fsdp2"),
    "tp": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"),
    "pp_1f1b": ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_microbatch_size", "1"),
}


def _validate_layouts(rank: int, world_size: int, dump: str, layouts: dict[str, tuple[str, ...]]) -> dict:
    """Train 3 steps under each layout (validating after step 2 and 3, so training resumes after a validation),
    then validate again; return the metrics, the training losses and the whole trained model."""
    results = {}
    for name, overrides in layouts.items():
        config = tiny_config(f"{dump}/{name}", "--training.steps", "3", "--validation.freq", "2",
                             "--metrics.enable_tensorboard", "false", *overrides)
        trainer = Trainer(config, DistInfo(rank, world_size, rank, torch.device("cpu")))
        losses = trainer.train()
        metrics = trainer.validator.validate()
        state = full_state(trainer)  # every rank gathers; rank 0's copy is enough
        results[name] = {"metrics": metrics, "state": state if rank == 0 else None, "dp_size": trainer.run.dp_size,
                         "losses": losses}
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_validate_layouts, 2, args=(str(tmp_path_factory.mktemp("layouts")), LAYOUTS))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_process_validation_equals_one_process_on_the_same_batches(two_ranks, layout, tmp_path):
    """Every rank reports the same loss, and it is the one-process loss of the same (trained) model over the
    batches of every data-parallel rank."""
    per_rank = [result[layout]["metrics"] for result in two_ranks]
    assert per_rank[0] == per_rank[1]
    dp_size = two_ranks[0][layout]["dp_size"]
    config = tiny_config(str(tmp_path))
    batches = [b for dp_rank in range(dp_size) for b in held_out_batches(config, dp_rank, dp_size, VALIDATION_STEPS)]
    expected = hand_computed_loss(reference_model(two_ranks[0][layout]["state"]), batches)
    assert per_rank[0]["validation_metrics/loss"] == pytest.approx(expected, rel=2e-6)


def test_time_spent_validating_is_left_out_of_the_throughput_window():
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])
    now[0] += 2.0
    timer.step_done(tokens=1000)
    with timer.excluded():
        now[0] += 8.0  # validating
    window = timer.take_window()
    assert window.elapsed_seconds == 2.0 and window.tokens == 1000
    assert timer.eta_seconds(steps_left=1) == 10.0  # the ETA still counts it: later validations take time too


@pytest.mark.slow
def test_training_goes_on_correctly_after_a_pipeline_validation(two_ranks):
    """pp2 and tp2 read the same batches (one data-parallel rank): the same training losses, including step 3,
    the first after the pipeline's forward-only schedule ran."""
    assert two_ranks[0]["pp_1f1b"]["losses"] == pytest.approx(two_ranks[0]["tp"]["losses"], rel=1e-5)
    assert len(two_ranks[0]["tp"]["losses"]) == 3
