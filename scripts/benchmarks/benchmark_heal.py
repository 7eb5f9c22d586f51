"""How fast a healing replica group receives its state, on this machine: torchft's HTTP transport (its default, which
titan_simple used before) against its process-group transport over the replica group (what titan_simple uses now),
side by side in one run, and the recovery timeout titan_simple derives for each size.

    python scripts/benchmarks/benchmark_heal.py  # 0.5, 1 and 2 GB per rank, both transports, CPU / gloo
    python scripts/benchmarks/benchmark_heal.py --gb 2 --transports pg  # one case
    python scripts/benchmarks/benchmark_heal.py --doc  # and write the table into docs/fault_tolerance.md

Two processes on this machine: rank 0 holds the live state (fp32 tensors of 256 MB, like a rank's parameter and
optimizer shards), rank 1 receives it into tensors of its own (in place, as a heal lands), and checks it bitwise.
Prints seconds, GB/s and the recovery timeout (``fault_tolerance.recovery_timeout`` with the defaults: 60 s + the
state at 1 GB/s).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from datetime import timedelta

import harness
import torch
import torch.multiprocessing as mp

from titan_simple.trainer.fault_tolerance import replica_process_group
from titan_simple.trainer.replica_state import recovery_timeout, state_bytes

DOC = harness.DOCS / "fault_tolerance.md"
BEGIN, END = "<!-- benchmark_heal: begin -->", "<!-- benchmark_heal: end -->"
TENSOR_BYTES = 256 * 2**20


def make_state(gb: float, fill: float) -> dict:
    n = max(1, math.ceil(gb * 1e9 / TENSOR_BYTES))
    return {"params": [torch.full((TENSOR_BYTES // 4,), fill + i, dtype=torch.float32) for i in range(n)]}


def transfer(rank: int, port: int, kind: str, gb: float, out: mp.Queue) -> None:
    """One heal of ``gb`` GB from rank 0 to rank 1 over ``kind`` ("pg" or "http"); rank 1 reports (seconds, ok)."""
    from torch.distributed import TCPStore
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    timeout = timedelta(seconds=600)
    state = make_state(gb, fill=1.0 if rank == 0 else -1.0)
    if kind == "pg":
        pg = replica_process_group(torch.device("cpu"), timedelta(seconds=60))
        pg.configure(f"127.0.0.1:{port}/heal", "benchmark", rank, 2)
        transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"), state_dict=lambda: state)
    else:
        transport = HTTPTransport(timeout=timeout, num_chunks=0)
    store.set(f"ready{rank}", transport.metadata())
    metadata = store.get("ready0").decode()
    store.get("ready1")
    started = time.perf_counter()
    if rank == 0:
        transport.send_checkpoint(dst_ranks=[1], step=1, state_dict=state, timeout=timeout)
        store.get("received")  # keep serving (HTTP) until the receiver has it all
    else:
        received = transport.recv_checkpoint(src_rank=0, metadata=metadata, step=1, timeout=timeout)
        seconds = time.perf_counter() - started
        store.set("received", "1")
        expected = make_state(gb, fill=1.0)
        ok = all(torch.equal(a, b) for a, b in zip(received["params"], expected["params"], strict=True))
        out.put((seconds, ok))
    if kind == "http":
        transport.shutdown(wait=False)


def measure(kind: str, gb: float) -> tuple[float, bool]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=transfer, args=(rank, port, kind, gb, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="state per rank, GB")
    parser.add_argument("--transports", nargs="+", default=["http", "pg"], choices=["http", "pg"])
    parser.add_argument("--doc", action="store_true", help="write the table into docs/fault_tolerance.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")
    rows = ["| state per rank | transport | seconds | GB/s | recovery timeout (derived) | bitwise |",
            "|---|---|---|---|---|---|"]
    for gb in args.gb:
        nbytes = state_bytes(make_state(gb, 0.0))
        limit = recovery_timeout(nbytes, 60.0, 1.0).total_seconds()
        for kind in args.transports:
            seconds, ok = measure(kind, gb)
            name = {"http": "HTTP (torchft default, before)", "pg": "process group (gloo), now"}[kind]
            rows.append(f"| {nbytes / 1e9:.2f} GB | {name} | {seconds:.2f} | {nbytes / 1e9 / seconds:.2f} | "
                        f"{limit:.0f} s | {'yes' if ok else 'NO'} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.doc:
        harness.write_block(DOC, BEGIN, END, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
