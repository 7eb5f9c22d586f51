"""Jobs in worlds that stay up: train.py's own ``main`` run in-process by gloo worlds of 1, 2 and 4 ranks that the
suite starts once, instead of a ``torchrun`` launch per job.

    proc = run_job(["--config", "llama3_debug.toml", "--training.steps", "2"], nproc=2)   # a CompletedProcess

A launch costs each of its processes the interpreter's start and the trainer's imports (4.6-7 s of CPU each on
this 2-core machine, docs/benchmarks.md), and every compiled job's ranks warm Inductor up again. A world's ranks
fork once from the suite's forkserver (tests/distributed_utils.py: torch, Inductor and the trainer already
imported) and then wait for jobs. A job is exactly what a launch runs: ``train.main(argv)`` with the environment
``torchrun --standalone`` gives a rank (plain ``python train.py`` for one process: no rank variables), the repo
root as working directory, stdout and stderr captured at the file descriptors (Python's and C++'s output alike).
What comes back is a ``subprocess.CompletedProcess`` as a launch's: ``returncode`` main's status for one
process, and for several what torchrun exits with (0, or 1 when any rank failed), each rank's in ``rank_codes``.

**A job leaves nothing for the next.** After it, each rank puts back what a job may change and a fresh process
would not have: the environment and working directory, ``torch.compile``'s state (``torch._dynamo.reset()``, and
the Dynamo, AOT autograd, Inductor and ``torch.compiler`` configs as they were), DTensor's cached sharding
decisions, torch's, Python's and NumPy's
random states, torch's thread count, deterministic mode, default dtype and grad mode, the SIGINT / SIGTERM
handlers, logging's handlers and levels, and warnings' filters; any process group still up is destroyed (the
trainer destroys its own: the default group and the mesh's subgroups, ``destroy_process_group()``). Then it
looks for what it cannot put back: a thread or child process still running, a process group, an environment
that differs. A job that left any of those fails its test (``JobLeftState``) and its world is replaced.
tests/test_job_pool.py proves both: two different jobs in either order give the losses fresh processes give, and
a job that leaves state behind is caught.

Not for jobs whose launch is the subject (titan-run, signals sent from outside, exit statuses through torchrun,
replica groups, elastic restarts, multinode), nor for an environment that differs from the suite's in what
torch reads once at import (``TORCHINDUCTOR_*``, ``TORCH_*``: the forkserver imported torch with the suite's):
``run_job`` refuses those (``harness.train_py`` then launches). ``fresh=True`` runs the job in processes forked
for it alone and gone after it: for what may run once per process (a dry run's fake world: DTensor caches its
meshes; a layout search's pool of pricing workers, kept for the process's life), at the cost of warming nothing;
what such a job leaves ends with its processes, so nothing is looked for.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import REPO, TRAIN_PY, free_port, job_env

WORLD_SIZES = (1, 2, 4)
# Variables torch (and its compiler) read once, when imported: the worlds were forked with the suite's values.
IMPORT_TIME_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TORCHDYNAMO_", "PYTORCH_")
# Variables a job may differ in from the suite without a launch: the job's own OpenMP thread count is applied
# with torch.set_num_threads (and the suite's value of the rest is what the preloaded modules read).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
# After a rank fails, how long its peers may take to report before the world is taken down (torchrun stops the
# other ranks at once; a peer blocked in a collective would wait for its timeout).
PEER_GRACE_S = 20.0


class JobLeftState(AssertionError):
    """A job in the pool left something behind that the next job would meet (named in the message)."""


class NotForThePool(ValueError):
    """A job the pool cannot run as a launch would (the reason in the message): launch it instead."""


# ------------------------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class Job:
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    entry: str  # "module:function" called with argv; "train" is train.py's main
    check_leaks: bool = True  # False for a world forked for this job alone: it ends with the job


@dataclass
class RankResult:
    rank: int
    code: int
    left: list[str] = field(default_factory=list)  # what the job left behind that could not be put back


def _script(path: Path, name: str) -> Any:
    """The checkout's script at ``path`` as the module ``name``, executed once per rank."""
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _call_entry(entry: str, argv: list[str]) -> int:
    """``entry``: "train" (train.py's main), "script:PATH" (a script's ``main(argv)``, PATH from the repo root) or
    "module:function"."""
    if entry == "train":
        return _script(TRAIN_PY, "train_entry").main(argv)
    if entry.startswith("script:"):
        path = REPO / entry[len("script:"):]
        return _script(path, f"job_pool_script_{path.stem}").main(argv)
    import importlib

    module_name, function = entry.split(":")
    return getattr(importlib.import_module(module_name), function)(argv)


def _run_entry(job: Job) -> int:
    """The job's exit status as its process would have it: main's return, ``SystemExit``'s code, or 1 with the
    traceback on stderr for an exception (as the interpreter prints it)."""
    try:
        code = _call_entry(job.entry, list(job.argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: B036 -- what an interpreter would report for an uncaught exception
        traceback.print_exc()
        code = 1
    return 0 if code is None else int(code)


def _live_children() -> set[int]:
    """Pids of this process's children that still run (zombies excluded)."""
    me, children = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.add(int(entry))
    return children


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return "?"


def _persistent_helper(pid: int) -> bool:
    """Inductor's pool of compile workers: started by torch at a process's first compile and kept by design for
    the process's later compiles (as a launched job's rank keeps it for all its graphs): warm, not a leak."""
    return "compile_worker" in _command_of(pid)


# Threads a library starts once per process and keeps by design, whatever job runs next: tqdm's monitor (one
# daemon per process, started by its first progress bar).
PERSISTENT_THREADS = ("tqdm_monitor",)


def _compile_pool_threads() -> set[int]:
    """Idents of Inductor's thread pool for C++ compiles (``AsyncCompile.pool``, made at a process's first compile
    and kept for its later ones, as in a launched rank): warm, not a leak."""
    from torch._inductor.async_compile import AsyncCompile

    if not AsyncCompile.pool.cache_info().currsize:
        return set()
    return {t.ident for t in AsyncCompile.pool()._threads}


class _State:
    """What a job may change in a rank, taken before it and put back after it."""

    def __init__(self) -> None:
        import numpy
        import torch
        import torch._dynamo.config
        import torch._functorch.config
        import torch._inductor.config
        import torch.compiler.config

        self.configs = [(module, module.get_config_copy()) for module in (
            torch._dynamo.config, torch._functorch.config, torch._inductor.config, torch.compiler.config)]
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = numpy.random.get_state()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        self.warning_filters = list(warnings.filters)
        root = logging.getLogger()
        self.root = (list(root.handlers), root.level)
        self.loggers = {name: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
                        for name, logger in logging.Logger.manager.loggerDict.items()
                        if isinstance(logger, logging.Logger)}
        self.threads_alive = {t.ident for t in threading.enumerate()}
        self.children = _live_children()

    def restore(self) -> None:
        import numpy
        import torch
        import torch._dynamo
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()
        # DTensor's sharding decisions, cached by op schema (meshes compared by value): a fresh process has none,
        # and an equal mesh of the next job must not get the decisions made on this job's (private names: a
        # rename fails the job loudly, "the pool failed around the job").
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        propagator._propagate_tensor_meta_cached.cache_clear()
        for module, values in self.configs:
            current = module.get_config_copy()
            changed = {name: value for name, value in values.items() if current.get(name) is not value
                       and current.get(name) != value}
            with warnings.catch_warnings():  # setting a deprecated key warns, also when it is set back
                warnings.simplefilter("ignore")
                module.load_config(changed)
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        numpy.random.set_state(self.numpy_rng)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.set_float32_matmul_precision(self.matmul_precision)
        for signum, handler in self.signals.items():
            signal.signal(signum, handler)
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()  # the module's cache of decisions (what ``warnings.simplefilter`` calls)
        root = logging.getLogger()
        for handler in root.handlers:
            if handler not in self.root[0]:
                handler.close()
        root.handlers[:] = self.root[0]
        root.setLevel(self.root[1])
        for name, logger in logging.Logger.manager.loggerDict.items():
            if not isinstance(logger, logging.Logger):
                continue
            level, handlers, propagate, disabled = self.loggers.get(name, (logging.NOTSET, [], True, False))
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled

    def left_behind(self) -> list[str]:
        """What the job left that ``restore`` cannot put back: threads and child processes still running."""
        left = []
        deadline = time.monotonic() + 5.0  # a thread or process that is ending gets a moment
        while True:
            kept = _compile_pool_threads()
            threads = [t for t in threading.enumerate() if t.ident not in self.threads_alive and t.is_alive()
                       and t.name not in PERSISTENT_THREADS and t.ident not in kept]
            children = [pid for pid in _live_children() - self.children if not _persistent_helper(pid)]
            if not (threads or children) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        left += [f"thread {t.name!r} still running" for t in threads]
        left += [f"child process {pid} still running ({_command_of(pid)[:120]})" for pid in children]
        return left


@contextlib.contextmanager
def _captured(stdout_path: str, stderr_path: str):
    """This process's file descriptors 1 and 2 (Python's streams and C++'s writes alike) into the two files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_in_rank(job: Job, rank: int, world_size: int, port: int, output: str) -> RankResult:
    """One rank's part of ``job``, its output into ``output``.{out,err}.rank``: the environment a launch gives
    it, the entry, then everything put back and what could not be, reported."""
    import torch

    state = _State()
    env = dict(job.env)
    for name in RANK_VARIABLES:
        env.pop(name, None)
    if world_size > 1:  # what torchrun --standalone sets for a rank; plain python sets none
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
                   ROLE_WORLD_SIZE=str(world_size), GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="job_pool", TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0")
    import torch.distributed as dist

    try:
        with _captured(f"{output}.out.{rank}", f"{output}.err.{rank}"):
            os.environ.clear()
            os.environ.update(env)
            os.chdir(job.cwd)
            threads = env.get("OMP_NUM_THREADS")
            torch.set_num_threads(int(threads) if threads else max(1, os.cpu_count() or 1))
            logging.getLogger().handlers[:] = []  # main's logging.basicConfig configures a fresh process
            code = _run_entry(job)
    finally:
        group_left = dist.is_initialized()  # the trainer destroys its groups: one still up is the job's leak
        state.restore()
    if not job.check_leaks:  # processes forked for this job alone end with it: nothing reaches another job
        return RankResult(rank, code)
    return RankResult(rank, code, ["a process group"] * group_left + state.left_behind())


def _rank_loop(rank: int, world_size: int, jobs: Any, results: Any) -> None:
    """A world's rank: take a job, run it, report, until told to stop (None) or its parent is gone."""
    from titan_simple.parallel.torch_private import use_one_gloo_worker_thread

    use_one_gloo_worker_thread()  # as the trainer's processes do (titan_simple.trainer.distributed)
    parent = os.getppid()
    while True:
        try:
            message = jobs.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the suite is gone
                return
            continue
        if message is None:
            return
        job, port, output = message
        try:
            result = run_in_rank(job, rank, world_size, port, output)
        except BaseException:  # noqa: B036 -- the pool's own failure: report it, the world is replaced
            result = RankResult(rank, 1, [f"the pool failed around the job:\n{traceback.format_exc()}"])
        results.put(result)


# ------------------------------------------------------------------------------------------- a world


class World:
    """``size`` ranks forked from the suite's forkserver, each waiting for jobs on its own queue."""

    def __init__(self, size: int) -> None:
        from tests.distributed_utils import _context

        ctx = _context()
        self.size = size
        self.results = ctx.Queue()
        self.queues = [ctx.Queue() for _ in range(size)]
        self.processes = [ctx.Process(target=_rank_loop, args=(rank, size, self.queues[rank], self.results),
                                      daemon=False, name=f"job_pool_{size}_{rank}") for rank in range(size)]
        for process in self.processes:
            process.start()
        self.jobs_run = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, job: Job, timeout_s: float) -> tuple[list[RankResult | None], str | None]:
        """Each rank's result (None: it did not report) and, if the world must be replaced, why."""
        port = free_port() if self.size > 1 else 0
        output = tempfile.mktemp(prefix="job_pool_")
        for q in self.queues:
            q.put((job, port, output))
        results: dict[int, RankResult] = {}
        deadline, broken = time.monotonic() + timeout_s, None
        while len(results) < self.size:
            try:
                result = self.results.get(timeout=1.0)
                results[result.rank] = result
                if result.code != 0:
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                continue
            except queue.Empty:
                pass
            if not self.alive():
                broken = "a rank died: " + ", ".join(
                    f"rank {r} exit code {p.exitcode}" for r, p in enumerate(self.processes) if not p.is_alive())
                break
            if time.monotonic() > deadline:
                broken = (f"timed out after {timeout_s:.0f} s" if all(r.code == 0 for r in results.values())
                          else f"a rank failed and its peers did not finish within {PEER_GRACE_S:.0f} s")
                break
        self.jobs_run += 1
        self.output = output
        if any(r.left for r in results.values()):
            broken = broken or "a job left state behind"
        return [results.get(rank) for rank in range(self.size)], broken

    def read_output(self) -> tuple[str, str]:
        """stdout and stderr of the last job, rank after rank (what torchrun's prefix-less output holds)."""
        streams = []
        for kind in ("out", "err"):
            parts = []
            for rank in range(self.size):
                path = Path(f"{self.output}.{kind}.{rank}")
                if path.exists():
                    parts.append(path.read_text(errors="replace"))
                    path.unlink()
            streams.append("".join(parts))
        return streams[0], streams[1]

    def stop(self) -> None:
        for q in self.queues:
            with contextlib.suppress(Exception):
                q.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


# ------------------------------------------------------------------------------------------- the pool

_worlds: dict[int, World] = {}
_stats = {"jobs": 0, "worlds_started": 0}


def _world(size: int) -> World:
    world = _worlds.get(size)
    if world is None or not world.alive():
        if world is not None:
            world.stop()
        world = _worlds[size] = World(size)
        _stats["worlds_started"] += 1
        if _stats["worlds_started"] == 1:
            # After multiprocessing registered its own exit function (it joins every child, which would wait for
            # ranks still waiting for jobs): atexit runs the last registered first.
            atexit.register(shutdown)
    return world


def shutdown() -> None:
    """Stop every world (the session's end; atexit too)."""
    for world in _worlds.values():
        world.stop()
    _worlds.clear()



def check_environment(env: Mapping[str, str]) -> None:
    """Refuse (``NotForThePool``) an environment whose import-time variables differ from the suite's: the worlds'
    torch read the suite's when the forkserver imported it."""
    suite = os.environ
    for name in sorted(set(env) | set(suite)):
        if name.startswith(IMPORT_TIME_PREFIXES) and env.get(name) != suite.get(name):
            raise NotForThePool(f"{name} is {env.get(name)!r} for the job and {suite.get(name)!r} for the suite: "
                                "torch read the suite's at import; launch this job")


def run_job(argv: Sequence[str | os.PathLike], nproc: int = 1, env: Mapping[str, str] | None = None,
            timeout: float = 600, fresh: bool = False, entry: str = "train") -> subprocess.CompletedProcess:
    """``train.py ARGV`` on ``nproc`` ranks of a world that stays up (``fresh``: processes forked for this job);
    a ``CompletedProcess`` as a launch's, with ``rank_codes``. Raises ``NotForThePool`` for a job to launch,
    ``JobLeftState`` when the job left state behind, AssertionError when a rank died or the job timed out."""
    if nproc not in WORLD_SIZES:
        raise NotForThePool(f"no world of {nproc} ranks (the pool has {WORLD_SIZES})")
    env = job_env() if env is None else dict(env)
    check_environment(env)
    job = Job(tuple(str(a) for a in argv), env, str(REPO), entry, check_leaks=not fresh)
    world = World(nproc) if fresh else _world(nproc)
    _stats["jobs"] += 1
    try:
        results, broken = world.run(job, timeout)
        stdout, stderr = world.read_output()
    finally:
        if fresh:
            world.stop()
    if broken is not None and not fresh:
        world.stop()
        _worlds.pop(nproc, None)
    codes = [r.code if r is not None else None for r in results]
    command = ["<job pool>", str(TRAIN_PY) if entry == "train" else entry.removeprefix("script:"), *job.argv]
    left = [f"rank {r.rank}: {item}" for r in results if r is not None for item in r.left]
    if left:
        raise JobLeftState(f"{' '.join(command)}\nleft behind:\n" + "\n".join(left) + f"\n--- stderr (tail)\n"
                           f"{stderr[-3000:]}")
    if broken is not None and any(code is None for code in codes):
        raise AssertionError(f"{' '.join(command)}\n{broken}; rank codes {codes}\n--- stdout (tail)\n"
                             f"{stdout[-3000:]}\n--- stderr (tail)\n{stderr[-3000:]}")
    if nproc == 1:
        returncode = codes[0]
    else:  # torchrun: 0, or 1 when any worker failed (ChildFailedError)
        returncode = 0 if all(code == 0 for code in codes) else 1
    proc = subprocess.CompletedProcess(command, returncode, stdout, stderr)
    proc.rank_codes = codes
    return proc


def stats() -> dict[str, int]:
    """Jobs run and worlds started so far in this session."""
    return dict(_stats)
