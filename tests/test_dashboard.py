"""The dashboard: a real TensorBoard server (scripts/tensorboard.sh) over a finished run, read over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.harness import FOUR_STEPS, REPO, free_port, job_env, one_torch_thread, read_metrics
from titan_simple.config import JobConfig, load_job_config
from titan_simple.trainer import metrics as m
from titan_simple.trainer.trainer import Trainer

# Validation (another part of issue 8) is switched on where the config knows it.
VALIDATION = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
              "--validation.local_batch_size", "2"]
SERVER_START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(dump folder, metrics.jsonl records) of a finished 4-step run logged at steps 1, 2 and 4."""
    dump = tmp_path_factory.mktemp("run")
    extra = VALIDATION if hasattr(JobConfig(), "validation") else []
    with one_torch_thread():
        Trainer(load_job_config([*FOUR_STEPS, *extra, "--job.dump_folder", str(dump)])).train()
    return dump, read_metrics(dump)


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


class Server:
    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def scalars(self, run: str, tag: str) -> list[list[float]]:
        """``[[wall_time, step, value], ...]`` of one series."""
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        return get_json(f"{self.url}/data/plugin/scalars/scalars?{query}")


@pytest.fixture(scope="module")
def server(finished_run, tmp_path_factory):
    """scripts/tensorboard.sh serving the finished run on a free loopback port, once it lists the loss tag."""
    dump, _ = finished_run
    port = free_port()
    log = tmp_path_factory.mktemp("tensorboard") / "server.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "tensorboard.sh"), str(dump), str(port)],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env=job_env(),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"tensorboard exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                tags = get_json(f"{url}/data/plugin/scalars/tags")
                if any(m.AVG_LOSS in run_tags for run_tags in tags.values()):
                    break  # serving, and the run's events are loaded
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"tensorboard did not serve the run within {SERVER_START_TIMEOUT_S} s:\n"
                            f"{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield Server(process, url, log)
    finally:
        if process.poll() is None:  # test_server_stops_by_pid did not run (deselected or failed before)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def the_run(server: Server) -> tuple[str, dict]:
    tags = get_json(f"{server.url}/data/plugin/scalars/tags")
    assert len(tags) == 1, tags  # one training run in the dump folder
    return next(iter(tags.items()))


def assert_series_equals_jsonl(server: Server, run: str, tag: str, records: list[dict]) -> None:
    """TensorBoard stores float32: each served value is the JSONL value rounded to float32, exactly."""
    expected = [(r["step"], float(np.float32(r[tag]))) for r in records if tag in r]
    served = [(int(step), value) for _, step, value in server.scalars(run, tag)]
    assert served == expected, tag


def test_dashboard_serves_loss_throughput_and_memory_equal_to_metrics_jsonl(server, finished_run):
    _, records = finished_run
    run, tags = the_run(server)
    memory_tags = [t for t in tags if t.startswith("memory/")]
    assert m.AVG_LOSS in tags and m.TOKENS_PER_SECOND in tags and memory_tags, sorted(tags)
    assert [step for _, step, _ in server.scalars(run, m.AVG_LOSS)] == [1, 2, 4]
    for tag in (m.AVG_LOSS, m.MAX_LOSS, m.GRAD_NORM, m.LR, m.TOKENS_PER_SECOND, m.TFLOPS, *memory_tags):
        assert_series_equals_jsonl(server, run, tag, records)
    losses = [value for _, _, value in server.scalars(run, m.AVG_LOSS)]
    assert 7.0 < losses[0] < 9.0 and losses[-1] < losses[0]  # ln(2000) = 7.6 at the start, then learning


def test_dashboard_serves_validation_loss(server, finished_run):
    _, records = finished_run
    if not any(m.VALIDATION_LOSS in r for r in records):
        pytest.skip(f"this build logs no {m.VALIDATION_LOSS} (validation not available): nothing to check")
    run, tags = the_run(server)
    assert m.VALIDATION_LOSS in tags, sorted(tags)
    assert_series_equals_jsonl(server, run, m.VALIDATION_LOSS, records)
    if m.VALIDATION_PERPLEXITY in tags:
        assert_series_equals_jsonl(server, run, m.VALIDATION_PERPLEXITY, records)


def children_of(pid: int) -> list[int]:
    """Direct children (e.g. TensorBoard's data server), from /proc.

    A thread may exit between listing ``task/`` and reading its ``children`` (its children then move to
    a live thread of the process): such a pass is read again, until one sees every thread it listed.
    """
    for _ in range(50):
        try:
            return [
                int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()
            ]
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError(f"/proc/{pid}/task kept changing under 50 reads: cannot list the server's children")


def test_server_stops_by_pid(server):
    pid = server.process.pid  # tensorboard.sh execs tensorboard: the script's PID is the server's
    assert "tensorboard" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    children = children_of(pid)
    os.kill(pid, signal.SIGTERM)
    assert server.process.wait(timeout=30) is not None
    assert not Path(f"/proc/{pid}").exists()  # reaped: the process is gone
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{child}").exists() for child in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for c in children if Path(f"/proc/{c}").exists()], "a child of tensorboard outlived it"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.url}/data/plugin/scalars/tags", timeout=5)
