"""The first hour of a new user, through the real entry point (``train.py``, torchrun for several processes).

* The data order is the global batch's, whatever the layout: 1 process, 2 (fully_shard), 4 (hybrid 2x2, and
  dp2 x tp2) with the same global batch give the same losses over 10 steps; a checkpoint of step 4 saved on 2
  processes continues on 1 and on 4 exactly as the uninterrupted run, and with another global batch it continues
  with the samples not yet consumed (data/sample_index.py).
* Short runs work; bad input is one line, a non-zero exit and no traceback, said once per job.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.harness import (
    FIRST_HOUR_GLOBAL_BATCH,
    FIRST_HOUR_JOB,
    assert_one_line_error,
    bad_input,
    logged_losses,
    train_in_process,
    train_py,
)

# FIRST_HOUR_JOB runs two of the debug model's six blocks: the data order and the resumes do not depend on depth,
# the run time does.
GLOBAL_BATCH = FIRST_HOUR_GLOBAL_BATCH
RTOL = 1e-5


def train(dump: Path, nproc: int, *extra: str, expect: int | None = 0) -> subprocess.CompletedProcess:
    return train_py(*FIRST_HOUR_JOB, "--job.dump_folder", dump, *extra, nproc=nproc, timeout=900, expect=expect)


def max_rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


CHECKPOINT_EVERY_4 = ("--checkpoint.enable", "--checkpoint.interval", "4")
LAYOUTS = {
    "fully_shard2": (2, "--training.local_batch_size", "4", *CHECKPOINT_EVERY_4),  # also the resume tests' save
    "hybrid2x2": (4, "--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2",
                  "--parallelism.data_parallel_shard_degree", "2"),
    "dp2_tp2": (4, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("one")
    train(dump, 1, "--training.local_batch_size", str(GLOBAL_BATCH))
    return logged_losses(dump)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each layout's dump folder, trained once for the module."""
    return {}


def run_layout(runs: dict[str, Path], tmp_path_factory, layout: str) -> Path:
    if layout not in runs:
        dump = tmp_path_factory.mktemp(layout)
        nproc, *extra = LAYOUTS[layout]
        result = train(dump, nproc, *extra)
        assert "set_vital" not in result.stderr  # torchdata's deprecation warning is not shown on every start
        runs[layout] = dump
    return runs[layout]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_sees_the_same_data(single, runs, tmp_path_factory, layout):
    dump = run_layout(runs, tmp_path_factory, layout)
    assert max_rel(logged_losses(dump), single) <= RTOL
    assert single[10] < single[1]


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_continues_on_one_and_on_four(single, runs, tmp_path_factory, tmp_path):
    saved = run_layout(runs, tmp_path_factory, "fully_shard2")  # saved every 4 steps
    uninterrupted = logged_losses(saved)
    step4 = saved / "checkpoint" / "step-4"
    assert step4.is_dir()
    load = ("--checkpoint.initial_load_path", str(step4), "--checkpoint.initial_load_model_only", "false")
    resumed_same = tmp_path / "same"
    train(resumed_same, 2, "--training.local_batch_size", "4", *load)
    after = {k: v for k, v in uninterrupted.items() if k > 4}
    assert logged_losses(resumed_same) == after  # the same layout: bitwise
    for name, nproc, extra in (("one", 1, ("--training.local_batch_size", "8")),
                               ("four", 4, ("--training.local_batch_size", "2"))):
        dump = tmp_path / name
        train(dump, nproc, *extra, *load)
        assert max_rel(logged_losses(dump), after) <= RTOL, name
    # Another global batch (8 -> 4 rows) on one process: the run reads samples 32, 33, ... (4 steps x 8 were
    # consumed), which its checkpoint's position shows: 32 + 2 steps x 4.
    dump = tmp_path / "half_batch"
    assert train_in_process(dump, "--training.local_batch_size", "4", "--training.global_batch_size", "4",
                            "--training.steps", "6", "--checkpoint.enable", *load) == 0
    import torch.distributed.checkpoint as dcp
    position = {"dataloader": {"consumed_samples": 0, "seq_len": 0}}
    dcp.load(position, checkpoint_id=str(dump / "checkpoint" / "step-6"), no_dist=True)
    assert position["dataloader"] == {"consumed_samples": 40, "seq_len": 64}


# ---------------------------------------------------------------------------------------------- short runs


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_short_runs_of_the_debug_config_just_work(steps, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert train_in_process(tmp_path, "--training.steps", str(steps), "--training.local_batch_size", "2") == 0
    assert sorted(logged_losses(tmp_path)) == list(range(1, steps + 1))
    # warmup 5 + decay 0.5 x steps do not fit: shortened, said once
    assert sum("warmup shortened" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------------------------------------- bad input


def test_your_own_folder_without_data_files_says_to_set_the_dataset(tmp_path, capsys):
    folder = tmp_path / "my_folder"
    folder.mkdir()
    (folder / "notes.md").write_text("not a data file")
    assert_one_line_error(*bad_input(tmp_path, capsys, "--training.dataset_path", str(folder)),
                          str(folder), "--training.dataset")


def test_your_own_folder_is_read(tmp_path):
    folder = tmp_path / "my_folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i} of my own text. " * 40}) + "\n"
                                            for i in range(40)))
    assert train_in_process(tmp_path / "dump", "--training.dataset_path", str(folder), "--training.steps", "2",
                            "--training.local_batch_size", "2") == 0
    mine = logged_losses(tmp_path / "dump")
    builtin = tmp_path / "builtin"
    assert train_in_process(builtin, "--training.steps", "2", "--training.local_batch_size", "2") == 0
    assert sorted(mine) == [1, 2] and mine != logged_losses(builtin)  # trained 2 steps, on other data than the corpus


def test_a_folder_of_empty_parquet_files_is_one_line(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), folder / "empty.parquet")
    stderr, code = bad_input(tmp_path, capsys, "--training.dataset", "parquet", "--training.dataset_path", str(folder))
    assert_one_line_error(stderr, code, "empty")
    assert "ArrowInvalid" not in stderr


def test_an_unreadable_file_is_one_line_naming_it(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "broken.parquet").write_bytes(b"PAR1 but not really")
    assert_one_line_error(*bad_input(tmp_path, capsys, "--training.dataset", "auto", "--training.dataset_path",
                                     str(folder)), "broken.parquet")


def test_a_hugging_face_load_that_fails_after_the_build_leaves_no_run_output(tmp_path, capsys, caplog,
                                                                            monkeypatch):
    """Weights whose file is truncated are refused before the model is built (the plan reads the safetensors
    headers); a load that fails once the model is built (here the copy itself) is one line too, exit 2, and either
    way none of the run's output is left in its dump folder: no metrics.jsonl, no TensorBoard run, no
    run_status.json (the loop never started). The sinks open at the first logged step (trainer/metrics.py)."""
    import torch

    from titan_simple.config import load_job_config
    from titan_simple.errors import ConfigError
    from titan_simple.models.from_config import model_args_for
    from titan_simple.models.hf_llama import save_hf
    from titan_simple.models.llama3 import Transformer
    from titan_simple.trainer import checkpoint

    args = model_args_for(load_job_config(list(FIRST_HOUR_JOB)))
    with torch.device("cpu"):
        weights = Transformer(args).state_dict()
    hf = save_hf(weights, args, tmp_path / "hf")
    (shard,) = hf.glob("*.safetensors")
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level("INFO", logger="titan_simple"):
        stderr, code = bad_input(tmp_path, capsys, "--metrics.enable_tensorboard", "true",
                                 "--checkpoint.initial_load_path", str(hf))
    assert_one_line_error(stderr, code, "cannot be read", shard.name)
    assert not any(r.getMessage().startswith("built: ") for r in caplog.records)  # refused before the build
    assert not (tmp_path / "dump").exists()

    shard.write_bytes(whole)
    caplog.clear()

    def fail(*args, **kwargs):
        raise ConfigError(f"Hugging Face weights {hf} cannot be read (a read error after the build)")

    monkeypatch.setattr(checkpoint, "copy_hf_weights", fail)
    with caplog.at_level("INFO", logger="titan_simple"):
        stderr, code = bad_input(tmp_path, capsys, "--metrics.enable_tensorboard", "true",
                                 "--checkpoint.initial_load_path", str(hf))
    assert_one_line_error(stderr, code, "a read error after the build")
    assert any(r.getMessage().startswith("built: ") for r in caplog.records)  # it failed after the build
    dump = tmp_path / "dump"
    assert not dump.exists() or not any(dump.iterdir()), sorted(p.name for p in dump.iterdir())


@pytest.mark.slow
def test_a_config_error_is_said_once_per_job(tmp_path):
    result = train(tmp_path, 2, "--training.local_batch_size", "3", expect=None)  # 8 is not a multiple of 3 x 2
    assert_one_line_error(result.stderr, result.returncode, "global_batch_size", expected_code=1)
    assert "set_vital" not in result.stderr
