"""Muon's state through checkpoints: a SIGTERM mid-run resumes bitwise on the same layout and within 1e-5 on another
(2 processes fully_shard -> 4 processes dp2 x tp2); the step folder exports to Hugging Face like any other; a
checkpoint of another optimizer is one line naming the fix, which then resumes.

Newton-Schulz in float32 here: bitwise resumption does not depend on its dtype, and torch's bfloat16 matmuls are
~50x slower on a CPU without native bf16.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_on_ranks
from tests.test_checkpoint import full_weights, make_trainer, run_export_script, stop_with_sigterm_after
from titan_simple.errors import ConfigError
from titan_simple.trainer.checkpoint import complete_steps
from titan_simple.trainer.distributed import DistInfo

MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--model.n_layers", "2",
        "--checkpoint.enable", "--checkpoint.interval", "100", "--training.mixed_precision_param", "float32")


def _run(rank: int, world_size: int, dump: str, extra: list[str], steps: int, stop_at: int | None) -> dict:
    torch.set_num_threads(1)
    trainer = make_trainer(Path(dump), *MUON, *extra, steps=steps,
                           dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")))
    if stop_at is not None:
        stop_with_sigterm_after(trainer, stop_at)
    start = trainer.global_step
    losses = trainer.train()
    return {"start": start, "losses": losses, "weights": full_weights(trainer)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return run_on_ranks(_run, 2, args=(str(tmp_path_factory.mktemp("whole")), [], 6, None))[0]


@pytest.mark.slow
def test_a_stopped_muon_run_resumes_bitwise_and_reshards_to_tensor_parallel(uninterrupted, tmp_path):
    stopped = run_on_ranks(_run, 2, args=(str(tmp_path / "stopped"), [], 6, 3))[0]
    assert stopped["losses"] == uninterrupted["losses"][:3]
    assert complete_steps(tmp_path / "stopped" / "checkpoint") == [3]
    shutil.copytree(tmp_path / "stopped", tmp_path / "tp")
    resumed = run_on_ranks(_run, 2, args=(str(tmp_path / "stopped"), [], 6, None))[0]
    assert resumed["start"] == 3 and resumed["losses"] == uninterrupted["losses"][3:]  # bitwise
    assert all(torch.equal(w, uninterrupted["weights"][k]) for k, w in resumed["weights"].items())
    # the momentum buffers (sharded like the weights) reshard: 4 processes, dp2 x tp2
    resharded = run_on_ranks(_run, 4, args=(str(tmp_path / "tp"), ["--parallelism.tensor_parallel_degree", "2",
                                                                    "--training.local_batch_size", "2"], 6, None))[0]
    assert resharded["start"] == 3
    worst = max(abs(a - b) / abs(b) for a, b in zip(resharded["losses"], uninterrupted["losses"][3:], strict=True))
    assert worst <= 1e-5, (resharded["losses"], uninterrupted["losses"][3:])
    out = tmp_path / "hf"
    assert run_export_script("--checkpoint", str(tmp_path / "stopped" / "checkpoint"), "--output", str(out)) == 0
    assert (out / "model.safetensors").exists()


def test_another_optimizers_checkpoint_is_one_line_and_loads_without_its_state(tmp_path):
    adamw = make_trainer(tmp_path, "--model.n_layers", "1", "--checkpoint.enable", steps=1)
    adamw.train()
    muon = ("--model.n_layers", "1", "--checkpoint.enable", "--optimizer.name", "Muon",
            "--optimizer.muon_ns_dtype", "float32")
    with pytest.raises(ConfigError, match=r"holds the optimizer state of AdamW or Adam and this run's \[optimizer\] "
                                          r"name is 'Muon'.*--checkpoint.exclude_from_loading") as error:
        make_trainer(tmp_path, *muon, steps=2)
    assert "\n" not in str(error.value)
    resumed = make_trainer(tmp_path, *muon, "--checkpoint.exclude_from_loading", '["optimizer"]', steps=2)
    assert resumed.global_step == 1
    assert resumed.train()[-1] > 0
    with pytest.raises(ConfigError, match=r"holds the optimizer state of Muon and this run's \[optimizer\] name is "
                                          r"'AdamW'"):
        make_trainer(tmp_path, "--model.n_layers", "1", "--checkpoint.enable", steps=3)
