"""End to end: the trainer on the debug model and the built-in corpus, 1 process and torchrun with 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.harness import (
    DEBUG,
    FP32,
    NO_TENSORBOARD,
    TWO_BLOCKS,
    finish,
    read_metrics,
    start_train_py,
    stop,
    train_py,
    wait_for_logged_steps,
)
from titan_simple.config import load_job_config
from titan_simple.core.step import StepHooks
from titan_simple.core.step_feature import StepFeature
from titan_simple.errors import NonFiniteTraining
from titan_simple.trainer.loop_feature import LoopFeature, Progress
from titan_simple.trainer.trainer import Trainer

# The debug model's six blocks, logged at steps 1, 3 and 6; fp32 on every CPU: the comparisons are at fp32 precision.
TINY = (*DEBUG, "--training.steps", "6", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.5", "--metrics.log_freq", "3", *FP32)


def run_in_process(tmp_path: Path, *extra: str) -> list[float]:
    config = load_job_config([*TINY, "--job.dump_folder", str(tmp_path), *extra])
    return Trainer(config).train()


def test_same_config_same_losses_and_files(tmp_path):
    first = run_in_process(tmp_path / "a")
    second = run_in_process(tmp_path / "b")
    assert first == second  # bitwise: seeding covers init and data
    assert len(first) == 6 and all(7.0 < loss < 9.0 for loss in first[:1])
    assert first[-1] < first[0]

    records = read_metrics(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 3, 6]
    assert [r["loss_metrics/global_avg_loss"] for r in records] == [first[0], first[2], first[5]]
    for key in ("grad_norm", "lr", "throughput(tps)", "tflops", "time_metrics/data_loading(%)"):
        assert all(key in r for r in records), key
    assert records[0]["lr"] == pytest.approx(3e-3 * 1 / 3)  # warmup step 1 of 2: lr x 1/(2+1)
    assert any(k.startswith("memory/peak_rss") for k in records[0])

    (run_dir,) = (tmp_path / "a" / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "loss_metrics/global_avg_loss" in tags and "throughput(tps)" in tags
    assert [e.step for e in events.Scalars("loss_metrics/global_avg_loss")] == [1, 3, 6]
    assert events.Scalars("loss_metrics/global_avg_loss")[-1].value == pytest.approx(first[-1], rel=1e-6)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    big = run_in_process(tmp_path / "big", "--training.local_batch_size", "4")
    accumulated = run_in_process(tmp_path / "acc", "--training.local_batch_size", "2",
                                 "--training.global_batch_size", "4")
    assert accumulated == pytest.approx(big, rel=1e-5)


@pytest.mark.slow
def test_torchrun_two_processes_simple_fsdp_matches_fsdp2(tmp_path):
    runs = {}
    for implementation in ("simple", "fsdp2"):
        result = train_py(*TINY, "--job.dump_folder", tmp_path / implementation, "--parallelism.fsdp_implementation",
                          implementation, nproc=2)
        wrapper = {"simple": "SimpleFSDP", "fsdp2": "FSDP2"}[implementation]
        assert "world 2 on cpu: dp_shard2" in result.stderr  # the plan, logged at start-up
        assert f"data parallel: {wrapper} fully_shard" in result.stderr
        runs[implementation] = read_metrics(tmp_path / implementation)  # only rank 0 writes
    simple, fsdp2 = runs["simple"], runs["fsdp2"]
    assert [r["step"] for r in simple] == [1, 3, 6]
    # The ranks read different data, so their mean losses differ: the max over ranks exceeds the mean.
    assert all(r["loss_metrics/global_max_loss"] > r["loss_metrics/global_avg_loss"] for r in simple)
    assert simple[-1]["loss_metrics/global_avg_loss"] < simple[0]["loss_metrics/global_avg_loss"]
    for a, b in zip(simple, fsdp2, strict=True):
        assert a["loss_metrics/global_avg_loss"] == pytest.approx(b["loss_metrics/global_avg_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def _poison_step(trainer: Trainer, bad_step: int) -> list[int]:
    """Make a gradient NaN at ``bad_step`` after its backward (as a NaN loss would); return the steps the
    optimizer took."""
    optimizer_step, stepped = trainer.run.optimizer.step, []

    class Poison(StepHooks):
        def phase(self, name: str) -> None:
            if name == "optimizer" and trainer.global_step == bad_step:
                next(p for p in trainer.run.parts.parameters() if p.grad is not None).grad.fill_(float("nan"))

    def counting_step(*args, **kwargs):
        stepped.append(trainer.global_step)
        return optimizer_step(*args, **kwargs)

    trainer.run.step.hooks, trainer.run.optimizer.step = Poison(), counting_step
    return stepped


def test_nonfinite_gradient_norm_stops_the_run_naming_the_step_and_checkpoint(tmp_path):
    config = load_job_config([*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                              "--checkpoint.interval", "2"])
    trainer = Trainer(config)
    stepped = _poison_step(trainer, bad_step=3)
    with pytest.raises(NonFiniteTraining, match=r"^step 3: .*nan.* the last good checkpoint is .*step-2\. .*and "
                                                r"resume from it, or set") as error:
        trainer.train()
    assert "no checkpoint" not in str(error.value)
    assert stepped == [1, 2]  # the poisoned step never reached the optimizer
    assert not (tmp_path / "checkpoint" / "step-3").exists()
    without = Trainer(load_job_config([*TINY, "--job.dump_folder", str(tmp_path / "none")]))
    _poison_step(without, bad_step=2)
    with pytest.raises(NonFiniteTraining, match=r"no checkpoint was saved\. .*and start again, or set") as error:
        without.train()
    assert "resume" not in str(error.value)


def test_skip_nonfinite_steps_skips_only_that_step(tmp_path):
    config = load_job_config([*TINY, "--job.dump_folder", str(tmp_path), "--training.skip_nonfinite_steps"])
    trainer = Trainer(config)
    stepped = _poison_step(trainer, bad_step=2)
    losses = trainer.train()
    assert stepped == [1, 3, 4, 5, 6] and len(losses) == 6
    assert trainer.run.lr_scheduler.last_epoch == 5  # the schedule did not advance on the skipped step


class JumpingFeature(LoopFeature):
    """A loop feature that records its calls, moves the loop once (before step 2 to after step 3, two batches
    further in the data), counts each step's tokens twice, adds a metric and a step feature, and never writes
    checkpoints."""

    def __init__(self, tokens_at_jump: int, rows_per_step: int) -> None:
        self.tokens_at_jump, self.rows_per_step = tokens_at_jump, rows_per_step
        self.calls: list[tuple] = []
        self.counter = CountingStepFeature()

    def step_features(self) -> list[StepFeature]:
        return [self.counter]

    def after_restore(self, run, progress) -> None:
        self.calls.append(("after_restore", run, progress()))

    def before_step(self, progress: Progress) -> Progress | None:
        self.calls.append(("before_step", progress))
        if progress.global_step != 1:
            return None
        return Progress(global_step=3, tokens_seen=self.tokens_at_jump,
                        consumed_samples=progress.consumed_samples + 2 * self.rows_per_step)

    def step_tokens(self, tokens: int) -> int:
        return 2 * tokens

    def metrics(self) -> dict[str, float]:
        return {"feature/answer": 42.0}

    def after_step(self, global_step: int) -> None:
        self.calls.append(("after_step", global_step))

    def writes_checkpoints(self) -> bool:
        return False

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


class CountingStepFeature(StepFeature):
    def __init__(self) -> None:
        self.forwards = 0

    def before_forward(self) -> None:
        self.forwards += 1


def test_loop_features_move_the_loop_count_its_tokens_and_decide_who_writes(tmp_path, monkeypatch):
    """The trainer's loop calls a LoopFeature's hooks (trainer/loop_feature.py) in their order: a Progress
    returned before a step moves the step, tokens and data position the loop reads on from; the feature's tokens,
    metrics and checkpoint vote are the loop's."""
    import titan_simple.trainer.trainer as trainer_module

    rows, tokens_per_step = 2, 2 * 64  # local batch 2 on one process, seq_len 64
    feature = JumpingFeature(tokens_at_jump=1000, rows_per_step=rows)
    monkeypatch.setattr(trainer_module, "build_loop_features", lambda *args: [feature])
    config = load_job_config([*TINY, "--training.steps", "4", "--job.dump_folder", str(tmp_path),
                              "--checkpoint.enable", "--checkpoint.interval", "1"])
    trainer = Trainer(config)
    assert trainer.run.step.features == (feature.counter,)
    losses = trainer.train()

    assert len(losses) == 2 and feature.counter.forwards == 2  # steps 1 and 4: the feature skipped 2 and 3
    assert feature.calls == [
        ("after_restore", trainer.run, Progress(global_step=0, tokens_seen=0, consumed_samples=0)),
        ("before_step", Progress(global_step=0, tokens_seen=0, consumed_samples=0)),
        ("after_step", 1),
        ("before_step", Progress(global_step=1, tokens_seen=2 * tokens_per_step, consumed_samples=rows)),
        ("after_step", 4),
        ("shutdown",),
    ]
    assert trainer.global_step == 4 and trainer.tokens_seen == 1000 + 2 * tokens_per_step
    assert trainer.dataloader.dataset.consumed == 4 * rows  # step 4 read the 4th global batch
    records = read_metrics(tmp_path)
    assert [(r["step"], r["feature/answer"]) for r in records] == [(1, 42.0), (4, 42.0)]
    assert not (tmp_path / "checkpoint").exists() or not any((tmp_path / "checkpoint").iterdir())
    assert json.loads((tmp_path / "run_status.json").read_text())["state"] == "finished"


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The PID of the torchrun worker with ``RANK=rank`` among the launcher's children."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc (Linux)")
def test_a_dead_rank_ends_the_job_promptly_and_is_named(tmp_path):
    """SIGKILL one worker mid-run: the launcher ends the job (no hang on the survivor's next collective) with
    a non-zero status and a report naming the dead rank and its signal. Two blocks: the job's depth is not what
    this checks, and a shallower job reaches its second step sooner."""
    import signal
    import time

    launcher = start_train_py(*TWO_BLOCKS, "--training.steps", "100000", "--training.local_batch_size", "2",
                              *NO_TENSORBOARD, "--job.dump_folder", tmp_path, nproc=2)
    try:
        wait_for_logged_steps(launcher, tmp_path / "metrics.jsonl", 2, timeout_s=600)
        victim = _worker_pid(launcher.pid, rank=1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        output = finish(launcher, timeout_s=300)
        ended_after = time.monotonic() - killed_at
    finally:
        stop(launcher)
    print(f"job ended {ended_after:.1f} s after rank 1 was killed")
    assert launcher.returncode != 0
    assert ended_after < 120, ended_after  # measured: a few seconds (gloo sees the closed connection at once)
    assert "rank      : 1" in output or "rank: 1" in output, output[-3000:]
    assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-3000:]
