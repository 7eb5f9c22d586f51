"""Weights & Biases (``[metrics] enable_wandb``, ``trainer/wandb_run.py``).

* An offline run of ``train.main`` read back with wandb's own reader of ``.wandb`` files holds exactly what
  ``metrics.jsonl`` holds (every key at every logged step, equal as floats), its config is the job config, and a
  run resumed from its checkpoint continues the same W&B run id with the later steps.
* On a stand-in ``wandb`` module (no service process): which run id and names reach ``wandb.init``, steps a resumed
  W&B run already holds, a W&B start that fails, a missing package, and that nothing imports wandb unless enabled.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    FIRST_HOUR_JOB,
    assert_one_line_error,
    bad_input,
    read_metrics,
    run_python,
    train_in_process,
)
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError
from titan_simple.trainer.metrics import AVG_LOSS, LR, VALIDATION_LOSS, MetricsLogger
from titan_simple.trainer.wandb_run import RUN_ID_FILE, WandbOptions, WandbRun, wandb_options

WANDB_VARIABLES = ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_SILENT",
                   "WANDB_RESUME", "WANDB_MODE")

# ------------------------------------------------------------------------------------- reading .wandb files


@dataclass
class OfflineRun:
    folder: Path
    run_id: str
    project: str
    history: dict[int, dict[str, float]]  # step -> the logged keys (wandb's own "_step", "_runtime"... left out)
    config: dict[str, Any]  # the run's config, wandb's own "_wandb" left out


def read_offline_run(folder: Path) -> OfflineRun:
    """An offline run folder's ``run-<id>.wandb``, with wandb's reader (wandb < 0.30: see pyproject.toml)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = folder.glob("run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    run_id, project, history, config = "", "", {}, {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, project = record.run.run_id, record.run.project
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[int(items["_step"])] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
    config.pop("_wandb", None)
    return OfflineRun(folder, run_id, project, history, config)


def jsonl_by_step(lines: list[str]) -> dict[int, dict[str, float]]:
    """metrics.jsonl's records merged by step (a validation step has a training record and a validation one)."""
    merged: dict[int, dict[str, float]] = {}
    for line in lines:
        record = json.loads(line)
        merged.setdefault(record.pop("step"), {}).update(record)
    return merged


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """WANDB_MODE=offline, wandb's own folders under tmp_path, no other WANDB_* variable; wandb torn down around
    the test (it reads the environment once, when it is first set up in a process)."""
    import wandb

    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    wandb.teardown()
    yield
    wandb.teardown()


# ------------------------------------------------------------------------------------ the acceptance run

RUN = ("--training.global_batch_size", "-1", "--training.local_batch_size", "2", "--metrics.log_freq", "2",
       "--metrics.enable_wandb", "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
       "--checkpoint.enable", "--checkpoint.interval", "2")


def test_an_offline_run_holds_what_metrics_jsonl_holds_and_a_resume_continues_it(offline, tmp_path, caplog, capsys):
    dump = tmp_path / "dump"
    with caplog.at_level(logging.INFO, logger="titan_simple"):
        assert train_in_process(dump, *RUN, "--training.steps", "4") == 0
    first_lines = (dump / "metrics.jsonl").read_text().splitlines()
    (folder,) = (dump / "wandb").glob("offline-run-*")
    first = read_offline_run(folder)
    assert first.run_id == (dump / RUN_ID_FILE).read_text().strip() and first.project == "titan_simple"
    assert sorted(first.history) == [1, 2, 4]
    assert first.history == jsonl_by_step(first_lines)  # same keys, same steps, equal floats
    assert {VALIDATION_LOSS, AVG_LOSS, LR, "throughput(tps)", "grad_norm"} <= set(first.history[4])
    argv = [*FIRST_HOUR_JOB, "--job.dump_folder", str(dump), *RUN]
    assert first.config == json.loads(json.dumps(load_job_config([*argv, "--training.steps", "4"]).to_dict()))
    # One line of ours says where the run is; wandb's own banner and summary are silenced.
    where = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B: ")]
    assert where == [f"W&B: offline run {first.run_id} in {folder} (upload: wandb sync {folder})"]
    captured = capsys.readouterr()
    assert "wandb:" not in captured.out + captured.err

    assert train_in_process(dump, *RUN, "--training.steps", "7") == 0  # resumes from checkpoint/step-4
    later_lines = (dump / "metrics.jsonl").read_text().splitlines()[len(first_lines):]
    (second_folder,) = set((dump / "wandb").glob("offline-run-*")) - {folder}
    second = read_offline_run(second_folder)
    assert second.run_id == first.run_id == (dump / RUN_ID_FILE).read_text().strip()
    assert sorted(second.history) == [6, 7]  # continues after the checkpoint's step 4
    assert second.history == jsonl_by_step(later_lines)
    assert second.config["training"]["steps"] == 7 and second.config["job"] == first.config["job"]


# ------------------------------------------------------------------------------ on a stand-in wandb module


class FakeWandbError(Exception):
    pass


class FakeRun:
    def __init__(self, run_id: str, step: int) -> None:
        self.id, self.name, self.step = run_id, "fake-name", step
        self.disabled, self.offline = False, True
        self.settings = types.SimpleNamespace(sync_dir=f"/offline/{run_id}")
        self.config_updates: list[dict] = []
        self.config = types.SimpleNamespace(update=lambda values, allow_val_change: self.config_updates.append(values))
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.exit_code: int | None = None

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(values)))
        self.step = step

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code


def fake_wandb(monkeypatch, *, resumed_step: int = 0, error: str | None = None) -> types.ModuleType:
    """A ``wandb`` module whose ``init`` records its arguments and returns a :class:`FakeRun` at ``resumed_step``
    (W&B's next step after a resume), or raises ``error``."""
    module = types.ModuleType("wandb")
    module.inits, module.runs = [], []

    def init(**kwargs: Any) -> FakeRun:
        module.inits.append(kwargs)
        if error:
            raise FakeWandbError(error)
        module.runs.append(FakeRun(kwargs["id"] or "newid123", resumed_step))
        return module.runs[-1]

    module.init, module.setup, module.Settings = init, lambda settings: None, lambda **kwargs: kwargs
    module.errors = types.SimpleNamespace(Error=FakeWandbError)
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_steps_a_resumed_wandb_run_already_holds_stay_in_the_files_only(monkeypatch, tmp_path, caplog):
    """Resumed from step 4 after W&B got up to step 6: steps 5 and 6 go to metrics.jsonl, not W&B (which would drop
    them with a warning per call); one warning says so; the run is the kept one and ends failed on an exception."""
    wandb = fake_wandb(monkeypatch, resumed_step=7)
    (tmp_path / RUN_ID_FILE).write_text("kept1234\n")
    logged = {5: {AVG_LOSS: 5.0}, 6: {AVG_LOSS: 6.0}, 7: {AVG_LOSS: 7.0}, 8: {AVG_LOSS: 8.0, LR: 0.5}}
    with pytest.raises(KeyboardInterrupt), caplog.at_level(logging.WARNING):
        with MetricsLogger(str(tmp_path), rank=0, enable_tensorboard=False, wandb=WandbOptions()) as metrics_logger:
            for step, values in logged.items():
                metrics_logger.log(step, values)
            metrics_logger.log(8, {VALIDATION_LOSS: 4.0})
            raise KeyboardInterrupt
    (run,) = wandb.runs
    assert wandb.inits[0]["id"] == "kept1234" and wandb.inits[0]["resume"] == "allow"
    assert run.logged == [(7, {AVG_LOSS: 7.0}), (8, {AVG_LOSS: 8.0, LR: 0.5}), (8, {VALIDATION_LOSS: 4.0})]
    assert [record["step"] for record in read_metrics(tmp_path)] == [5, 6, 7, 8, 8]
    warnings = [r.getMessage() for r in caplog.records if "W&B run" in r.getMessage()]
    assert warnings == ["W&B run kept1234 already holds steps up to 6 (this run resumed from an earlier checkpoint): "
                        "steps before 7 go to metrics.jsonl and TensorBoard only"]
    assert run.exit_code == 1


def test_run_id_names_and_folder_reach_wandb_init(monkeypatch, tmp_path):
    wandb = fake_wandb(monkeypatch)
    (tmp_path / RUN_ID_FILE).write_text("old12345\n")
    job = {"training": {"steps": 3}}

    def start(first_step: int, **options: str) -> dict[str, Any]:
        run = WandbRun(str(tmp_path), WandbOptions(config=job, **options))
        run.open(first_step)
        run.close(failed=False)
        assert wandb.runs[-1].config_updates == [job] and wandb.runs[-1].exit_code == 0
        return wandb.inits[-1]

    fresh = start(1)  # a run from step 1 is a new W&B run, whatever the folder kept
    assert fresh["id"] is None and (tmp_path / RUN_ID_FILE).read_text() == "newid123\n"
    assert (fresh["project"], fresh["entity"], fresh["name"], fresh["dir"]) == ("titan_simple", None, None,
                                                                                str(tmp_path))
    (tmp_path / RUN_ID_FILE).write_text("old12345\n")
    assert start(11)["id"] == "old12345"  # resumed: continues the kept run
    monkeypatch.setenv("WANDB_RUN_ID", "fromenv1")
    monkeypatch.setenv("WANDB_PROJECT", "envproject")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    from_env = start(11)
    assert (from_env["id"], from_env["project"], from_env["dir"]) == ("fromenv1", "envproject", None)
    keys = start(1, project="mine", entity="team", run_name="trial")  # a key set in the config wins over the env
    assert (keys["project"], keys["entity"], keys["name"], keys["group"]) == ("mine", "team", "trial", None)
    # fault tolerance: each replica group's rank 0 logs a run of its own, grouped under the job
    options = wandb_options(load_job_config(["--fault_tolerance.enable", "--fault_tolerance.replica_id", "1",
                                             "--fault_tolerance.group_size", "2", "--job.dump_folder", "/x/job7"]))
    assert (options.run_name, options.group) == ("job7 replica 1", "job7")
    assert (start(1, run_name=options.run_name, group=options.group)["group"]) == "job7"


def test_a_wandb_start_that_fails_is_one_line_and_writes_no_file(monkeypatch, tmp_path):
    fake_wandb(monkeypatch, error="No API key configured. Use `wandb login` to log in.\nsecond line")
    metrics_logger = MetricsLogger(str(tmp_path / "dump"), rank=0, enable_tensorboard=True, wandb=WandbOptions())
    with pytest.raises(ConfigError) as failure:
        metrics_logger.log(1, {AVG_LOSS: 1.0})
    assert str(failure.value) == ("[metrics] enable_wandb: W&B could not start the run (No API key configured. Use "
                                  "`wandb login` to log in.); run `wandb login`, set WANDB_MODE=offline, or pass "
                                  "--metrics.enable_wandb=false.")
    metrics_logger.close()
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == []  # no metrics.jsonl, no tb, no run id


def test_a_missing_wandb_is_one_line_before_anything_is_built(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else real(name, *args))
    stderr, code = bad_input(tmp_path, capsys, "--metrics.enable_wandb")
    assert_one_line_error(stderr, code, "[metrics] enable_wandb = true needs the wandb package: "
                                        "pip install -e '.[wandb]' or --metrics.enable_wandb=false.")
    assert not (tmp_path / "dump").exists()


def test_wandb_is_imported_only_when_enabled():
    """Importing wandb takes ~1.7 s: the trainer, the plan and the metrics do not, nor does a run without it."""
    probe = ("import sys, titan_simple.trainer.trainer, titan_simple.core.plan, titan_simple.trainer.wandb_run; "
             "print('wandb' in sys.modules)")
    done = run_python("-c", probe, timeout=300)
    assert done.stdout.split() == ["False"]
