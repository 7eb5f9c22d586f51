"""Imported last by the suite's forkserver (``tests/distributed_utils._PRELOAD``): one tiny compile, forward and
backward, so that every rank forked from the server (``run_on_ranks``' jobs, the pool's worlds in
tests/job_pool.py, the dry runs' processes) starts with torch's compiler warm, as the second compile of a process
finds it: Dynamo's, AOT autograd's and Inductor's lazily imported modules loaded, the CPU's vector ISA probed,
the C++ compiler found. Measured on this machine: a process's first compile of a small graph 5.0 s, its second
1.1 s (warm disk caches; 13.9 s and 3.7 s cold); each compiling rank of the suite paid that difference.

What the compile leaves in the process must not reach a forked child half made, nor change what a test counts:
Inductor's thread pool for C++ compiles is shut down and forgotten (a child would inherit the pool without its
threads and wait forever on its first compile: torch re-creates it after fork only for its process pools),
Dynamo's caches are reset and its counters cleared. ``warm`` checks that no thread but the main one (and tqdm's
monitor, a daemon that only paces progress bars) is left: the forkserver must not fork with threads alive.

The private names used (``AsyncCompile.pool``, an ``lru_cache``'d executor; ``torch._dynamo.utils.counters``)
are checked by tests/test_job_pool.py, which fails loudly if torch renames them.
"""

from __future__ import annotations

import threading


def warm() -> None:
    import torch
    import torch._dynamo
    from torch._inductor.async_compile import AsyncCompile

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x @ w).sum()

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.compile(step)(x, w).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if AsyncCompile.pool.cache_info().currsize:
        AsyncCompile.pool().shutdown(wait=True)
        AsyncCompile.pool.cache_clear()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.name != "tqdm_monitor"]
    if alive:
        raise RuntimeError(f"the forkserver's warm-up left threads running: {alive}")


warm()
