"""How a run ended, for Slurm: SIGINT / SIGTERM to a torchrun job stop it cleanly with a checkpoint and a
``stopped`` run status (torchrun itself exits 1), a crash never reads as ``stopped``, and
``scripts/multinode.slurm`` requeues after a stop and after nothing else."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import (
    DEBUG,
    ONE_ROW,
    REPO,
    TRAIN_PY,
    finish,
    output_of,
    run_script,
    start_python,
    wait_for_logged_steps,
)
from titan_simple.trainer.checkpoint_files import complete_steps
from titan_simple.trainer.run_status import RunStatus, read_run_status

RUN_STATUS = REPO / "scripts" / "run_status.py"
SLURM_SCRIPT = REPO / "scripts" / "multinode.slurm"
RESUMABLE = 75


GROUP_1 = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1"]


def run_status_verdict(dump: Path, since: float | None = None, *extra: str) -> tuple[int, str]:
    since_args = [] if since is None else ["--since", str(since)]
    result = run_script(RUN_STATUS, *since_args, *DEBUG, "--job.dump_folder", dump, *extra, timeout=60, expect=None)
    return result.returncode, output_of(result)


# ------------------------------------------------------------------------------------- the verdict, no training


@pytest.mark.parametrize("state, fields, code, says", [
    ("finished", {"checkpoint": None}, 0, "finished: step 4 of 4"),
    ("stopped", {"signal": "SIGTERM", "checkpoint": "/x/checkpoint/step-4"}, RESUMABLE,
     "stopped by SIGTERM at step 4 of 4"),
    ("stopped", {"signal": "SIGINT", "checkpoint": None}, 1, "with no checkpoint"),
    ("failed", {"error": "RuntimeError: boom"}, 1, "failed at step 4 of 4"),
    ("running", {}, 1, "killed while running"),
])
def test_run_status_script_says_what_to_do_with_the_job(tmp_path, state, fields, code, says):
    RunStatus(str(tmp_path), rank=0, steps=4).write(state, 4, **fields)
    verdict_code, output = run_status_verdict(tmp_path)
    assert verdict_code == code and says in output, output


@pytest.mark.parametrize("state, fields, code", [
    ("finished", {"checkpoint": None}, 0),
    ("stopped", {"signal": "SIGTERM", "checkpoint": "/x/checkpoint/step-4"}, RESUMABLE),
    ("failed", {"error": "RuntimeError: boom"}, 1),
])
def test_run_status_script_reads_a_replica_groups_own_status(tmp_path, state, fields, code):
    """With fault tolerance each group writes <dump>/replica_<id>/run_status.json; the script, given the group's
    config, reads that one (another group's status says nothing about this group)."""
    RunStatus(str(tmp_path / "replica_1"), rank=0, steps=4).write(state, 4, **fields)
    RunStatus(str(tmp_path / "replica_0"), rank=0, steps=4).write("running", 2)
    verdict_code, says = run_status_verdict(tmp_path, None, *GROUP_1)
    assert verdict_code == code and f"{tmp_path}/replica_1/run_status.json" in says, says


def test_a_status_older_than_the_launch_or_none_is_not_resumable(tmp_path):
    assert run_status_verdict(tmp_path) == (1, f"{tmp_path}/run_status.json: no run status: the run did not reach "
                                               "training\n")
    RunStatus(str(tmp_path), rank=0, steps=4).write("stopped", 2, signal="SIGTERM", checkpoint="/x/step-2")
    assert run_status_verdict(tmp_path)[0] == RESUMABLE
    code, says = run_status_verdict(tmp_path, since=time.time() + 1)  # launched after that stop: a stale status
    assert code == 1 and "stale" in says
    RunStatus(str(tmp_path), rank=1, steps=4).write("failed", 3)  # only rank 0 writes
    assert read_run_status(tmp_path)["state"] == "stopped"


# ----------------------------------------------------------------------------- the Slurm script, with fake Slurm

FAKE_SRUN = """#!/bin/bash
# Stands in for srun + torchrun: leaves the run status a real run would, exits as torchrun would.
dump="$(echo "$@" | sed -E 's/.*--job.dump_folder ([^ ]+).*/\\1/')"
echo "$@" > "$dump/srun_args"
case "$*" in *--fault_tolerance.replica_id*)  # a replica group writes its status into its own folder
    dump="$dump/replica_$(echo "$@" | sed -E 's/.*--fault_tolerance.replica_id ([0-9]+).*/\\1/')"; mkdir -p "$dump" ;;
esac
case "$FAKE_OUTCOME" in
    stopped) echo '{"state": "stopped", "step": 11, "steps": 50, "signal": "SIGTERM",
              "checkpoint": "'"$dump"'/checkpoint/step-11", "time": '"$(date +%s)"'}' > "$dump/run_status.json"
             exit 1 ;;
    finished) echo '{"state": "finished", "step": 50, "steps": 50, "time": '"$(date +%s)"'}' > "$dump/run_status.json"
              exit 0 ;;
    crashed) echo '{"state": "running", "step": 0, "steps": 50, "time": '"$(date +%s)"'}' > "$dump/run_status.json"
             exit 1 ;;
    stale) exit 1 ;;  # died before training: the status is the previous launch's
esac
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node001; else echo "$@" >> "$SCONTROL_LOG"; fi
"""


def run_slurm_script(tmp_path: Path, outcome: str, *extra: str) -> tuple[int, list[str], str]:
    """``scripts/multinode.slurm`` as the batch step runs it, with srun and scontrol faked on PATH (``extra``: more
    train.py options, e.g. a replica group's)."""
    bin_dir, dump = tmp_path / "bin", tmp_path / "dump"
    bin_dir.mkdir()
    dump.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    # What an earlier launch left: it stopped on request, a minute ago.
    earlier = {"state": "stopped", "step": 5, "steps": 50, "signal": "SIGTERM", "checkpoint": str(dump / "x"),
               "time": time.time() - 60}
    status_folder = dump / "replica_1" if extra else dump
    status_folder.mkdir(exist_ok=True)
    (status_folder / "run_status.json").write_text(json.dumps(earlier))
    log = tmp_path / "scontrol.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[001-002]", "FAKE_OUTCOME": outcome, "SCONTROL_LOG": str(log)}
    result = subprocess.run(["bash", str(SLURM_SCRIPT), "configs/llama3_debug.toml", "--job.dump_folder", str(dump),
                             *extra], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    requeues = log.read_text().splitlines() if log.exists() else []
    assert "--shutdown_timeout 240" in (dump / "srun_args").read_text()
    return result.returncode, requeues, result.stderr


def test_slurm_script_is_valid_bash_and_asks_for_the_stop_signal():
    subprocess.run(["bash", "-n", str(SLURM_SCRIPT)], check=True)
    directives = [line.split()[1] for line in SLURM_SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"--signal=TERM@300", "--requeue", "--open-mode=append"} <= set(directives)


@pytest.mark.parametrize("outcome, status, requeued", [
    ("stopped", 0, True),  # SIGTERM before the time limit, checkpoint saved: requeue, resume from it
    ("finished", 0, False),
    ("crashed", 1, False),  # killed while running: fail the job
    ("stale", 1, False),  # died before training; the "stopped" on disk is the earlier launch's
])
@pytest.mark.parametrize("group", [False, True], ids=["plain", "replica_group"])
def test_slurm_script_requeues_after_a_stop_on_request_only(tmp_path, outcome, status, requeued, group):
    """The same for one replica group of a fault-tolerant job (its status is in its own folder)."""
    code, requeues, stderr = run_slurm_script(tmp_path, outcome, *(GROUP_1 if group else ()))
    assert code == status, stderr
    assert requeues == (["requeue 4242"] if requeued else []), stderr


# ------------------------------------------------------------------------------------ real torchrun jobs (slow)


def start_torchrun(entry: Path, dump: Path, *extra: str) -> subprocess.Popen:
    return start_python(entry, *ONE_ROW, "--training.steps", "500", "--job.dump_folder", dump, "--checkpoint.enable",
                        "--checkpoint.interval", "1000", *extra, nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_torchrun_stops_with_a_checkpoint_and_a_stopped_status(tmp_path, signum):
    launched_at = time.time()
    launcher = start_torchrun(TRAIN_PY, tmp_path)
    wait_for_logged_steps(launcher, tmp_path / "metrics.jsonl", 2, timeout_s=300)
    launcher.send_signal(signum)  # Ctrl-C, or Slurm's SIGTERM before the time limit
    output = finish(launcher, timeout_s=120)

    # torch 2.13's torchrun re-raises its SignalException: 1 whatever the workers did (README, Checkpoints).
    assert launcher.returncode == 1, output[-3000:]
    assert "stopped at step" in output and "on request" in output, output[-3000:]
    assert "exitcode" not in output  # no worker failed: both exited 0
    status = read_run_status(tmp_path)
    step = status["step"]
    assert status["state"] == "stopped" and status["signal"] == signum.name and 2 <= step < 500, status
    assert status["checkpoint"] == str(tmp_path / "checkpoint" / f"step-{step}")
    assert complete_steps(tmp_path / "checkpoint") == [step]
    code, says = run_status_verdict(tmp_path, since=launched_at)
    assert code == RESUMABLE, says


RAISING_RANK = """
import runpy, sys
sys.path.insert(0, {repo!r})
from titan_simple.trainer.trainer import Trainer

def train_step(self, batches):
    if self.dist.rank == 1 and self.global_step == 3:
        raise RuntimeError("rank 1 fails at step 3")
    return original(self, batches)

original, Trainer.train_step = Trainer.train_step, train_step
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_crashing_rank_never_leaves_a_stopped_status(tmp_path):
    """torchrun answers a failed rank by SIGTERMing the others: that must not read as a stop on request, even
    where an earlier launch left ``stopped``."""
    RunStatus(str(tmp_path), rank=0, steps=500).write("stopped", 1, signal="SIGTERM", checkpoint="/earlier/step-1")
    entry = tmp_path / "raising_rank.py"
    entry.write_text(RAISING_RANK.format(repo=str(REPO), train=str(TRAIN_PY)))
    launched_at = time.time()
    output = finish(start_torchrun(entry, tmp_path), timeout_s=300)

    assert "rank 1 fails at step 3" in output, output[-3000:]
    status = read_run_status(tmp_path)
    assert status["state"] == "failed" and status["step"] == 3, status  # rank 0's step 3 failed with its peer
    assert "on request" not in output, output[-3000:]
    code, says = run_status_verdict(tmp_path, since=launched_at)
    assert code == 1 and "failed at step 3" in says, says
