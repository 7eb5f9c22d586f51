"""Run a test function on N gloo ranks (CPU) in child processes and hand the results back.

    results = run_on_ranks(check_something, world_size=2, args=(16,))   # [result_rank0, result_rank1]

``fn(rank, world_size, *args)`` runs inside an initialized default process group (gloo, rendezvous through
a ``FileStore`` in a fresh temporary directory, so there is no port to race for). Whatever it returns
must be picklable. Ranks fork from a forkserver that has already imported torch, Inductor and the trainer
(spawning each rank cost ~3.5 s of CPU in imports: minutes of the suite on 2 cores); each rank gets the
caller's environment at the time of the call, but what the preloaded modules read when imported (Inductor's
``TORCHINDUCTOR_*`` config, for one) is the environment of the session's first call, and a rank writes to the
stdout / stderr the server was started with. An exception in any rank is re-raised in the parent with the
child's traceback; a rank that dies without reporting (segfault, abort) fails the call with its exit code.
Every rank ends with ``dist.barrier(); dist.destroy_process_group()``: gloo occasionally aborts at interpreter
exit otherwise.

In-process helper: ``single_rank_process_group()`` (a gloo default group of one rank for the block). What tests
share to start the project's commands (and ``free_port``) is in tests/harness.py.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_simple.parallel.torch_private import use_one_gloo_worker_thread


@contextlib.contextmanager
def single_rank_process_group() -> Iterator[None]:
    """In this process, a gloo default process group of one rank (rank 0, in-memory store) for the block;
    destroyed on exit, also when the block raises."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gloo_worker_threads(group: dist.ProcessGroup | None = None) -> int:
    """How many worker threads ``group``'s gloo backend runs collectives on (None: the default group); read
    through torch's private ``_Options._threads``."""
    group = group or dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._threads


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds each failing rank's traceback or exit code."""


# Imported once in the forkserver, before any rank forks from it. Nothing here may start a thread or a process
# group at import (a forked child would inherit it half-made).
# The last, tests/forkserver_warmup.py, compiles one tiny graph so that every fork starts with the compiler warm.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "titan_simple.trainer.trainer",
            "titan_simple.compile.compiler", "tests.parity", "tests.forkserver_warmup"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: at the first run_on_ranks of the session
    return ctx


def _worker(fn, rank, world_size, store_path, args, kwargs, results, threads, environ):
    os.environ.clear()
    os.environ.update(environ)  # the caller's, now (the forkserver's is that of the first call)
    torch.set_num_threads(threads)
    ok = False
    try:
        use_one_gloo_worker_thread()  # as the trainer's processes do (titan_simple.trainer.distributed)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args, **kwargs)
        ok = True
        # Plain pickle to bytes: torch.multiprocessing would share tensors through file descriptors that
        # vanish when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: B036 -- report anything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if ok:  # after a failure the peers may be gone: a barrier would hang
                dist.barrier()
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 1800.0,  # compiled multi-layout jobs on a loaded 2-core machine took over 600 s
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own process.

    ``fn`` must be importable by name (a module-level function), as multiprocessing pickles it by reference.
    """
    ctx = _context()
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, store_path, tuple(args), kwargs or {}, results, threads,
                      dict(os.environ)),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            while len(outcomes) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                    outcomes[rank] = (ok, pickle.loads(value) if ok else value)
                    if not ok:
                        timeout_s = min(timeout_s, 5.0)  # give the others a moment to report, no more
                    continue
                except queue.Empty:
                    pass
                timeout_s -= 1.0
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outcomes]
                if dead or timeout_s <= 0:
                    # Give a dying rank's report a moment to arrive before declaring it silent.
                    try:
                        while True:
                            rank, ok, value = results.get(timeout=2.0)
                            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
                    except queue.Empty:
                        pass
                    break
        finally:
            failed = any(not ok for ok, _ in outcomes.values()) or len(outcomes) < world_size
            for p in procs:
                p.join(timeout=30 if not failed else 5)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = [f"--- rank {r} raised:\n{value}" for r, (ok, value) in sorted(outcomes.items()) if not ok]
    if errors or len(outcomes) < world_size:
        silent = [
            f"--- rank {r} did not report (exit code {p.exitcode})" for r, p in enumerate(procs) if r not in outcomes
        ]
        if not errors and timeout_s <= 0:
            silent.insert(0, "timed out")
        raise RankFailed("\n".join(errors + silent))
    return [outcomes[r][1] for r in range(world_size)]


def run_worlds_side_by_side(jobs: Sequence[tuple[Callable[..., Any], int, Sequence[Any]]]) -> list[list[Any]]:
    """``[run_on_ranks(fn, world_size, args) for fn, world_size, args in jobs]``, the worlds started together.

    For compiled jobs: their ranks compile once (``titan_simple/compile/once.py``), so while a 2-rank world's leader
    compiles, its follower waits and one of the 2 cores idles; two such worlds side by side keep both busy (issue
    61). Each world is as ``run_on_ranks`` makes it alone (its own store, the same threads per rank, so the same
    compiled kernels); a failure in any is raised after all have ended.
    """
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(run_on_ranks, fn, world_size, args) for fn, world_size, args in jobs]
        return [future.result() for future in futures]
