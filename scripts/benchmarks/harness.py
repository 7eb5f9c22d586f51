"""The one harness of scripts/benchmarks: what every benchmark script needs around its own measurement.

A benchmark here starts jobs (``train.py``, another script, or itself in a worker mode; one process, or N under
``torchrun --standalone``), reads what they logged (``metrics.jsonl``) and writes its table into a doc between two
marker lines. Those pieces live here once, so that every script launches with the same environment, reads the
trainer's metrics the same way and rewrites its doc block the same way:

* ``REPO`` / ``DOCS`` / ``TRAIN``: the checkout's root, its docs folder and its ``train.py``;
* ``benchmark_env``: the environment of a benchmark job (one OpenMP thread per process, Hugging Face offline,
  this checkout first on ``PYTHONPATH``);
* ``launch``: ``python ARGS`` (or ``torchrun ... ARGS`` on ``nproc`` processes) from the repo root, as a ``Job``:
  exit status, output, seconds; ``Job.check`` turns a failure into one error with the output's tail;
* ``read_metrics``: the records of a run's ``metrics.jsonl``;
* ``splice`` / ``write_block``: replace the block between a doc's two marker lines (a missing marker is one error);
* ``save_json``: a script's raw results (``results.json``, ``--json FILE``).

Scripts import it as ``import harness`` (Python puts a script's own folder first on ``sys.path``, torchrun and
multiprocessing's spawned children too). It imports only the standard library: no torch, nothing slow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
TRAIN = REPO / "train.py"
TAIL_CHARS = 3000  # how much of a failed job's output an error shows


def benchmark_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a benchmark job: one OpenMP thread per process (what torchrun gives each of
    several ranks anyway), Hugging Face offline, this checkout first on ``PYTHONPATH``; the variables whose names
    start with one of ``drop`` removed (e.g. ``TORCHINDUCTOR_`` for torch's default caches), ``extra`` set last."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(drop)}
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=python_path)
    env.update(extra)
    return env


def python_command(*args: str | Path, nproc: int | None = None) -> list[str]:
    """``python ARGS`` with this interpreter, or ``torchrun --standalone --nproc_per_node=N ARGS`` with ``nproc``."""
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*runner, *(str(a) for a in args)]


@dataclasses.dataclass(frozen=True)
class Job:
    """One finished command: its exit status (``"timeout"`` when it ran past its limit), its output, when it
    started (``time.time()``) and how many seconds it ran."""

    command: list[str]
    returncode: int | str
    stdout: str
    stderr: str
    started: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def output(self) -> str:
        """stdout then stderr (a job launched with a log file has it all in stdout)."""
        return self.stdout + self.stderr

    def tail(self, chars: int = TAIL_CHARS) -> str:
        return self.output[-chars:]

    def check(self, what: str) -> Job:
        """This job if it succeeded; else ``SystemExit`` naming ``what``, its status and its output's tail."""
        if not self.ok:
            raise SystemExit(f"{what} failed ({self.returncode}):\n{self.tail()}")
        return self

    def last_json(self) -> Any:
        """The JSON on the last line of stdout (what a worker printed as its result)."""
        return json.loads(self.stdout.strip().splitlines()[-1])


def launch(*args: str | Path, nproc: int | None = None, env: Mapping[str, str] | None = None, cwd: Path = REPO,
           log: Path | None = None, timeout: float | None = None) -> Job:
    """Run ``python ARGS`` (under torchrun on ``nproc`` processes, see ``python_command``) in ``cwd``, with
    ``env`` (default: ``benchmark_env()``; pass ``os.environ`` for a job run as a user runs it), and wait for it.
    Its output is captured, or with ``log`` written to that file as it comes (stderr into stdout) and read back."""
    command = python_command(*args, nproc=nproc)
    options: dict[str, Any] = {"env": dict(benchmark_env() if env is None else env), "cwd": cwd, "timeout": timeout}
    started, start = time.time(), time.perf_counter()
    if log is None:
        status, stdout, stderr = _run_captured(command, options)
    else:
        status, stdout, stderr = _run_logged(command, options, log)
    return Job(command, status, stdout, stderr, started, time.perf_counter() - start)


def _run_captured(command: list[str], options: dict[str, Any]) -> tuple[int | str, str, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, **options)
    except subprocess.TimeoutExpired as e:
        return "timeout", _text(e.stdout), _text(e.stderr)
    return done.returncode, done.stdout, done.stderr


def _run_logged(command: list[str], options: dict[str, Any], log: Path) -> tuple[int | str, str, str]:
    with open(log, "w") as out:
        try:
            status: int | str = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, **options).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    return status, Path(log).read_text(errors="replace"), ""


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (``path`` is the file or the folder the trainer logs to: its dump
    folder, or ``replica_<g>`` under fault tolerance), in order. Blank lines and a line a killed run left cut short
    are skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def splice(doc: str, begin: str, end: str, text: str) -> str:
    """``doc`` with the block from the line ``begin`` to the next ``end`` (both kept) holding ``text`` instead of
    what it held: ``begin``, newline, ``text``, newline, ``end``; everything outside untouched. A missing marker is
    a ``ValueError`` naming it (the block is written only where the doc has placed it)."""
    start = doc.find(begin)
    if start < 0:
        raise ValueError(f"no {begin!r} marker: add the lines {begin!r} and {end!r} where the block belongs")
    stop = doc.find(end, start + len(begin))
    if stop < 0:
        raise ValueError(f"no {end!r} marker after {begin!r}: the block has no end")
    return f"{doc[:start]}{begin}\n{text}\n{end}{doc[stop + len(end):]}"


def write_block(path: Path, begin: str, end: str, text: str) -> None:
    """Rewrite the block between ``begin`` and ``end`` in the doc at ``path`` (``splice``); a missing marker ends
    the script with one line naming the doc and the marker."""
    try:
        path.write_text(splice(path.read_text(), begin, end, text))
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None


def save_json(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON (one space a level) at ``path``."""
    Path(path).write_text(json.dumps(data, indent=1))
