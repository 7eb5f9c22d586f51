"""Minimal reproduction: ProcessGroupGloo's two worker threads free the same heap string (torch 2.13, CPU).

    torchrun --standalone --nproc_per_node=2 docs/research/repro/repro_gloo_abort.py  # aborts, usually
    torchrun --standalone --nproc_per_node=2 docs/research/repro/repro_gloo_abort.py --op all_reduce      # runs clean
    torchrun --standalone --nproc_per_node=2 docs/research/repro/repro_gloo_abort.py --gloo-threads 1     # runs clean

No model, no compile, no titan_simple import. Each rank keeps ``--in-flight`` asynchronous functional all-gathers
of a 16-element tensor outstanding (``torch.ops._c10d_functional.*``, what Inductor's generated code calls) and
waits for the oldest, ``--ops`` times.

The cause (read in torch's source, checked in the 2.13.0 wheel's machine code; docs/research/
upstream_gloo_worker_thread_race.md): after running a collective, ``ProcessGroupGloo::runLoop`` assigns the
collective's name to ``pgStatus_->lastCompletedWorkName``, a ``std::string`` shared by all worker threads of the
process group, after it has released the work queue's mutex. Two worker threads finishing at the same time both
free the string's old buffer. An all-gather's name, ``ALLGATHER_COALESCED``, is too long for the string's inline
buffer, so each assignment allocates and frees a 32-byte chunk; ``ALLREDUCE`` fits inline and frees nothing, which
is why ``--op all_reduce`` (the same race, no heap buffer) and one worker thread (no race) run clean. glibc sees the
double free later, as ``malloc(): unaligned tcache chunk detected`` / ``double free`` / SIGSEGV in whichever thread
allocates next.

Exit status 0 and ``ok`` on rank 0 mean no crash in this run; it races, so rates vary with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def gloo_with_threads(threads: int) -> None:
    """Gloo process groups created after this call run ``threads`` worker threads (torch's constructor starts 2;
    only the private ``ProcessGroupGloo._Options._threads`` changes it)."""
    base = dist.ProcessGroupGloo

    class _Gloo(base):
        def __init__(self, store, rank, size, timeout):
            options = base._Options()
            options._timeout = timeout
            options._devices = [base.create_default_device()]
            options._threads = threads
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = _Gloo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("all_gather", "all_reduce"), default="all_gather")
    parser.add_argument("--ops", type=int, default=200_000, help="collectives per rank")
    parser.add_argument("--in-flight", type=int, default=64, help="collectives outstanding at once")
    parser.add_argument("--gloo-threads", type=int, default=0, help="0 = torch's default (2)")
    args = parser.parse_args()
    if args.gloo_threads:
        gloo_with_threads(args.gloo_threads)
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    functional = torch.ops._c10d_functional
    tensor = torch.ones(16)
    if args.op == "all_gather":
        def issue() -> torch.Tensor:
            return functional.all_gather_into_tensor.default(tensor, world, group)
    else:
        def issue() -> torch.Tensor:
            return functional.all_reduce.default(tensor, "sum", group)
    start = time.time()
    pending: list[torch.Tensor] = []
    for _ in range(args.ops):
        pending.append(issue())
        if len(pending) >= args.in_flight:
            functional.wait_tensor.default(pending.pop(0))
    for result in pending:
        functional.wait_tensor.default(result)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok: {args.ops} {args.op} collectives, gloo worker threads {args.gloo_threads or 2}, "
              f"{time.time() - start:.0f} s", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown with gloo threads alive (a different abort at exit)


if __name__ == "__main__":
    main()
