"""What the tests share to run the project's own commands and read what those leave behind.

* ``REPO`` / ``TRAIN_PY``: the checkout's root and its ``train.py``.
* The tiny jobs' overrides, one constant per shape some test depends on (``DEBUG``, ``TWO_BLOCKS``, ``SMALL``,
  ``ONE_ROW``, ``FIRST_HOUR_JOB``, ``FOUR_STEPS``, ``COMPILED_JOB``); a test adds what its own assertions need.
* ``job_env``: the environment of a command a test starts (one OpenMP thread per process, Hugging Face offline).
* ``run_python`` / ``train_py``: ``python ARGS`` (under ``torchrun --standalone`` when ``nproc`` > 1) from the
  repo root, waited for; it must exit with ``expect`` (0 unless told), else the assertion shows the command, its
  status and the tail of both streams. ``train_compiled``: ``COMPILED_JOB`` so; ``dry_run``: a dry run and its
  report; ``two_at_a_time``: single-threaded commands side by side. ``start_python`` / ``start_train_py`` start
  one and return at once (jobs a test signals or kills), with ``wait_for_logged_steps``, ``finish`` and ``stop``.
* ``read_jsonl`` / ``read_metrics`` / ``logged_losses``: what a run logged.
* ``train_main`` / ``train_in_process`` / ``bad_input`` / ``assert_one_line_error``: train.py's ``main`` in this
  process (the entry point without an interpreter start), and what a refused input must look like.
* ``load_script``: a script of the checkout as a module; ``free_port``; ``one_torch_thread``.

It imports only the standard library at the top: tests/conftest.py imports it before torch reads its environment.
The fixtures that several test files share are in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "train.py"
TAIL_CHARS = 3000  # how much of each stream a failed command's assertion shows
T = TypeVar("T")
AVG_LOSS = "loss_metrics/global_avg_loss"  # titan_simple.trainer.metrics.AVG_LOSS (not imported: no torch here)

# ------------------------------------------------------------------------------------------- the tiny jobs

DEBUG = ("--config", "llama3_debug.toml")
FP32 = ("--training.mixed_precision_param", "float32")  # "auto" is bf16 on a CPU with native bf16: fp32 everywhere
NO_TENSORBOARD = ("--metrics.enable_tensorboard", "false")
# The end-to-end jobs whose losses tests compare: two of the debug model's six blocks (every block compiles to the
# same kernels and trains alike; start-up, compile and step time grow with depth), 64-token rows, fp32, every step
# in metrics.jsonl.
TWO_BLOCKS = (*DEBUG, "--model.n_layers", "2", "--training.seq_len", "64", *FP32, "--metrics.log_freq", "1")
# Short runs in one process: rows of 32 tokens, 2 per step, one warmup step, nothing written to TensorBoard.
SMALL = (*DEBUG, "--training.seq_len", "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1",
         *NO_TENSORBOARD)
# Multi-process jobs whose time is their processes' start: one 32-token row per rank, every step logged.
ONE_ROW = (*DEBUG, "--training.seq_len", "32", "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "1",
           "--metrics.log_freq", "1", *NO_TENSORBOARD)
# A new user's first job (tests/test_first_hour.py, tests/test_wandb.py): 10 steps of one global batch of 8 rows,
# whatever the layout.
FIRST_HOUR_GLOBAL_BATCH = 8
FIRST_HOUR_JOB = (*TWO_BLOCKS, "--training.steps", "10", "--training.global_batch_size", str(FIRST_HOUR_GLOBAL_BATCH),
                  *NO_TENSORBOARD)
# A finished run of the whole debug model that tests read back (tests/test_dashboard.py, tests/test_generate.py):
# 4 steps logged at 1, 2 and 4.
FOUR_STEPS = (*DEBUG, "--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "2",
              "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "2")
# The compiled job of the compile-cache tests (tests/test_compile_cache.py, tests/test_compile_once.py).
COMPILED_JOB = (*TWO_BLOCKS, "--training.local_batch_size", "2", "--compile.enable", "--lr_scheduler.warmup_steps", "1")

# ------------------------------------------------------------------------------------------- commands


def job_env(threads: str | None = "1", drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a command a test starts: ``OMP_NUM_THREADS`` = ``threads`` (one per process
    unless told: what torchrun gives each of several ranks, and on 2 shared cores more threads only contend; None:
    unset, as in a shell that never set it), Hugging Face offline, the variables named in ``drop`` removed and
    ``extra`` set last."""
    env = {name: value for name, value in os.environ.items() if name not in (*drop, "OMP_NUM_THREADS")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env


def compile_cache_env(threads: str | None = "1") -> dict[str, str]:
    """``job_env`` for a compiled job that keeps its graphs in its own folder (``[compile] cache_dir``, by default
    under the dump folder) rather than the suite's shared kernel folder, with torch's FX graph and AOT autograd
    caches on (an environment that forces them off turns compile once off)."""
    return job_env(threads, drop=("TORCHINDUCTOR_CACHE_DIR",), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="1")


def python_command(*args: str | Path, nproc: int = 1) -> list[str]:
    """``python ARGS`` with this interpreter, or with ``nproc`` > 1 ``torchrun --standalone --nproc_per_node=N``."""
    runner = [sys.executable]
    if nproc > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*runner, *(str(a) for a in args)]


def output_of(proc: subprocess.CompletedProcess) -> str:
    """stdout then stderr (the ranks of a torchrun job log to either)."""
    return proc.stdout + proc.stderr


def report(proc: subprocess.CompletedProcess) -> str:
    """What an assertion on a finished command shows: the command, its exit status, the tail of each stream."""
    command = " ".join(str(a) for a in proc.args) if isinstance(proc.args, list) else str(proc.args)
    return (f"{command}\nexit status {proc.returncode}\n--- stdout (tail)\n{(proc.stdout or '')[-TAIL_CHARS:]}\n"
            f"--- stderr (tail)\n{(proc.stderr or '')[-TAIL_CHARS:]}")


def run_python(*args: str | Path, nproc: int = 1, env: Mapping[str, str] | None = None, cwd: Path = REPO,
               timeout: float = 600, expect: int | None = 0) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (torchrun on ``nproc`` processes when > 1) in ``cwd`` with ``env`` (default
    ``job_env()``), output captured; assert that it exited with ``expect`` (None: any status, the test checks)."""
    proc = subprocess.run(python_command(*args, nproc=nproc), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=job_env() if env is None else dict(env))
    if expect is not None:
        assert proc.returncode == expect, report(proc)
    return proc


# train.py modes that may run once per process (a dry run's and a precompile's fake world: DTensor caches meshes).
ONCE_PER_PROCESS = ("--dry_run", "--compile.precompile_world_size")


def train_py(*args: str | Path, nproc: int = 1, env: Mapping[str, str] | None = None, timeout: float = 600,
             expect: int | None = 0, launch: bool = False) -> subprocess.CompletedProcess:
    """``train.py ARGS`` as a user's command runs it (the repo root, torchrun for several ranks): by default a job
    of the suite's pool of worlds that stay up (tests/job_pool.py: train.py's ``main`` in-process, the same
    ``CompletedProcess`` back), in processes forked for it alone for a dry run or a precompile; launched as a
    process with ``launch`` (where the launch is the subject: exit statuses through torchrun, signals) or when
    the pool cannot run it as a launch would (another world size, an environment torch read at import)."""
    if not launch:
        from tests.job_pool import NotForThePool, run_job  # noqa: PLC0415 (imports torch: not at the top)

        fresh = any(str(arg).split("=")[0] in ONCE_PER_PROCESS for arg in args)
        try:
            proc = run_job(args, nproc=nproc, env=env, timeout=timeout, fresh=fresh)
        except NotForThePool:
            pass
        else:
            if expect is not None:
                assert proc.returncode == expect, report(proc)
            return proc
    return run_python(TRAIN_PY, *args, nproc=nproc, env=env, timeout=timeout, expect=expect)


def run_script(script: str | Path, *args: str | Path, env: Mapping[str, str] | None = None, timeout: float = 600,
               expect: int | None = 0) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (SCRIPT a path from the repo root with a ``main(argv)``) as a job of the suite's pool
    (tests/job_pool.py: the script's ``main`` in a 1-rank world), or launched when the pool cannot run it as a
    launch would; what ``run_python`` returns and asserts."""
    from tests.job_pool import NotForThePool, run_job  # noqa: PLC0415 (imports torch: not at the top)

    path = Path(script) if Path(script).is_absolute() else REPO / script
    relative = path.resolve().relative_to(REPO)
    try:
        proc = run_job(args, env=env, timeout=timeout, entry=f"script:{relative}")
    except NotForThePool:
        return run_python(REPO / relative, *args, env=env, timeout=timeout, expect=expect)
    if expect is not None:
        assert proc.returncode == expect, report(proc)
    return proc


def dry_run(folder: Path, *args: str, output: str = "dry_run.json",
            timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """``train.py --dry_run ARGS`` writing to ``folder`` (whatever its exit status): the process, and the JSON
    report ``output`` in ``folder`` if it wrote one (``search.json`` for a layout search)."""
    proc = train_py("--dry_run", "--job.dump_folder", folder, *args, timeout=timeout, expect=None)
    path = Path(folder) / output
    return proc, json.loads(path.read_text()) if path.exists() else None


def train_compiled(dump: Path, *extra: str, nproc: int = 2, threads: str | None = "1") -> str:
    """The output of ``COMPILED_JOB`` on ``nproc`` ranks writing to ``dump``, in ``compile_cache_env(threads)``;
    it must succeed."""
    proc = train_py(*COMPILED_JOB, "--job.dump_folder", dump, *extra, nproc=nproc, env=compile_cache_env(threads),
                    timeout=1200)
    return output_of(proc)


def two_at_a_time(calls: Sequence[Callable[[], T]]) -> list[T]:
    """The results of ``calls`` in order, run two at a time (threads): for commands that are each one single-threaded
    process, such as a dry run, on the 2 cores the suite is timed on (a layout search is not: it prices on a pool
    of its own)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda call: call(), calls))

def start_python(*args: str | Path, nproc: int = 1, env: Mapping[str, str] | None = None,
                 log: Path | None = None) -> subprocess.Popen:
    """``python ARGS`` (torchrun when ``nproc`` > 1) started from the repo root and not waited for: stdout and
    stderr together, in a pipe (read by ``finish``) or with ``log`` in that file."""
    command, env = python_command(*args, nproc=nproc), job_env() if env is None else dict(env)
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO)
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def start_train_py(*args: str | Path, nproc: int = 1, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    return start_python(TRAIN_PY, *args, nproc=nproc, env=env)


def stop(process: subprocess.Popen) -> None:
    """Kill ``process`` if it still runs, and reap it."""
    if process.poll() is None:
        process.kill()
        process.wait()


def finish(process: subprocess.Popen, timeout_s: float) -> str:
    """The output of a started process once it exits (killed after ``timeout_s``, which then raises)."""
    try:
        return process.communicate(timeout=timeout_s)[0] or ""
    finally:
        stop(process)


def wait_for_logged_steps(process: subprocess.Popen, metrics: Path, steps: int, timeout_s: float) -> None:
    """Return once ``metrics`` (a run's metrics.jsonl) holds ``steps`` records; fail if ``process`` ends first
    (with its output) or ``timeout_s`` passes (``process`` then killed)."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if process.poll() is not None:
            output = process.communicate()[0] or ""
            raise AssertionError(f"the job exited ({process.returncode}) before logging {steps} steps:\n"
                                 f"{output[-TAIL_CHARS:]}")
        if time.monotonic() > deadline:
            stop(process)
            raise AssertionError(f"the job did not log {steps} steps within {timeout_s} s")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------- what a run left


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One record per line (every line must be one)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of the ``metrics.jsonl`` in ``folder`` (a run's dump folder, or a replica group's)."""
    return read_jsonl(Path(folder) / "metrics.jsonl")


def logged_losses(folder: Path) -> dict[int, float]:
    """step -> the global average loss, of each step the run in ``folder`` logged (validation records, which
    hold no training loss, left out)."""
    return {record["step"]: record[AVG_LOSS] for record in read_metrics(folder) if AVG_LOSS in record}


# ------------------------------------------------------------------------------------------- in this process


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """The checkout's script at ``path`` (absolute, or relative to the repo root) executed as the module ``name``
    (default: the file's stem), registered in ``sys.modules`` first (a script's dataclasses look their module up
    while it runs)."""
    name = name or Path(path).stem
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def train_main(*argv: str | Path) -> int:
    """train.py's ``main(argv)`` in this process (one rank): the entry point without an interpreter start."""
    return load_script("train.py", "train_entry").main([str(a) for a in argv])


def train_in_process(dump: Path, *extra: str) -> int:
    """``FIRST_HOUR_JOB`` through ``train_main``, writing to ``dump``."""
    return train_main(*FIRST_HOUR_JOB, "--job.dump_folder", dump, *extra)


def bad_input(tmp_path: Path, capsys: Any, *extra: str) -> tuple[str, int]:
    """``train_in_process`` on bad input (dump folder ``tmp_path / "dump"``): its stderr, where no traceback may
    appear, and its exit status."""
    code = train_in_process(tmp_path / "dump", *extra)
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr, stderr
    return stderr, code


def assert_one_line_error(stderr: str, code: int, *fragments: str, expected_code: int = 2) -> None:
    """Exit status ``expected_code`` (train.py exits 2; torchrun reports a failed worker as 1) and exactly one
    ``error: `` line, holding every fragment."""
    assert code == expected_code, stderr[-TAIL_CHARS:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-TAIL_CHARS:]  # torchrun adds its own report of the failed ranks after it
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound once and released, so another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the block (a run in the pytest process: on 2 shared cores more threads only
    contend; a 2-process job's ranks have one each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
