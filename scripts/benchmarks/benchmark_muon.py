"""Muon's optimizer step and state against AdamW's and against the naive distributed Muon, side by side.

    .venv/bin/python scripts/benchmarks/benchmark_muon.py          # ~5 minutes on 2 cores; a quiet machine
    .venv/bin/python scripts/benchmarks/benchmark_muon.py --doc    # also rewrites docs/benchmarks.md's table

One ``torchrun`` job per (model, processes): SimpleFSDP fully_shard over 2 or 4 processes, fp32 weights, the debug
model and ``debugmodel_large``. Each job builds its run as the trainer does (``core/assemble.build_run``), gives every
parameter a random gradient and times ``optimizer.step()`` (median of the steps after two warm-ups) for three
optimizers on the same shards:

* **AdamW**: torch's, every parameter;
* **Muon, owners** (ours, ``core/muon.py``): each block matrix orthogonalized once, on its owner rank, the blocks
  moved by two all-to-alls;
* **Muon, naive** (the baseline here): every rank all-gathers every momentum-updated matrix whole and orthogonalizes
  all of them, then keeps its own block; N times the Newton-Schulz work and a full all-gather per step.

Newton-Schulz runs in float32 here: in bfloat16 (the default) this CPU without native bf16 takes ~50x longer per
matmul, which would only scale the Muon rows. Optimizer state is the bytes of the state tensors one rank holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import harness

DOC = harness.DOCS / "benchmarks.md"
MARKERS = ("<!-- muon table -->", "<!-- /muon table -->")
JOBS = [("debugmodel", 2), ("debugmodel", 4), ("debugmodel_large", 2), ("debugmodel_large", 4)]
OPTIMIZERS = ("AdamW", "Muon, owners", "Muon, naive")
STEPS = 6  # timed optimizer steps, after two warm-ups


def _worker(flavor: str) -> None:
    """One rank: each optimizer's step time (median, ms), state bytes and Newton-Schulz calls, as JSON on rank 0."""
    import torch
    import torch.distributed as dist

    from titan_simple.config import load_job_config
    from titan_simple.core.assemble import build_run
    from titan_simple.core.plan import resolve_plan

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results, mesh = {}, None
    for name in OPTIMIZERS:
        muon = () if name == "AdamW" else ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
        config = load_job_config(["--config", "llama3_debug.toml", "--model.flavor", flavor,
                                  "--training.mixed_precision_param", "float32", *muon])
        plan = resolve_plan(config, dist.get_world_size(), "cpu")
        mesh = mesh or plan.dims.build_mesh("cpu")  # one world mesh per process, as in the trainer
        run = build_run(plan, torch.device("cpu"), mesh=mesh, lr_schedule=False)
        if name == "Muon, naive":
            _make_naive(run.optimizer)
        results[name] = _time_steps(run, torch, dist)
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _time_steps(run, torch, dist) -> dict:
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for part in run.parts.modules for p in part.parameters()]
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for step in range(STEPS + 2):
        for p in params:  # the same random gradient on every rank, each keeping its shard
            grad = torch.randn(p.shape, generator=generator).to(p.dtype) * 1e-3
            p.grad = (distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                      if isinstance(p, DTensor) else grad)
        dist.barrier()
        start = time.perf_counter()
        run.optimizer.step()
        dist.barrier()
        if step >= 2:
            seconds.append(time.perf_counter() - start)
    state = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
                for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"ms": 1e3 * statistics.median(seconds), "state_bytes": state,
            "newton_schulz_calls": getattr(run.optimizer, "newton_schulz_calls", 0) // (STEPS + 2)}


def _make_naive(optimizer) -> None:
    """The baseline: every rank gathers each matrix whole (an all-gather per matrix) and orthogonalizes all."""
    from torch.distributed.tensor import DTensor

    from titan_simple.core import muon

    def naive_step(group: dict) -> None:
        params = group["params"]
        updates = [optimizer._momentum_update(p, group["momentum"], group["nesterov"]) for p in params]
        dtype = muon.NEWTON_SCHULZ_DTYPES[group["ns_dtype"]]
        for p, update, block in zip(params, updates, optimizer.owners.local_blocks, strict=True):
            whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape,
                                       stride=p.stride()).full_tensor() if isinstance(p, DTensor) else update
            orthogonal = optimizer._newton_schulz(whole, group["ns_steps"], dtype)
            optimizer.newton_schulz_calls += 1
            row, rows, col, cols = block
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(orthogonal[row:row + rows, col:col + cols],
                       alpha=-muon.adjusted_lr(group["lr"], group["adjust_lr_fn"], tuple(p.shape)))

    optimizer._muon_step = naive_step  # step() calls it for the Muon group


def _table(results: dict) -> str:
    lines = ["| model | processes | optimizer | step ms (median) | vs AdamW | state per rank (MiB) | "
             "Newton-Schulz per rank per step |", "|---|---:|---|---:|---:|---:|---:|"]
    for (flavor, world), rows in results.items():
        adamw = rows["AdamW"]["ms"]
        for name in OPTIMIZERS:
            r = rows[name]
            calls = r["newton_schulz_calls"] if name != "AdamW" else "-"
            lines.append(f"| {flavor} | {world} | {name} | {r['ms']:.1f} | {r['ms'] / adamw:.2f}x | "
                         f"{r['state_bytes'] / 2**20:.2f} | {calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--doc", action="store_true", help="rewrite the table in docs/benchmarks.md")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    results = {}
    for flavor, world in JOBS:
        job = harness.launch(__file__, "--worker", flavor, nproc=world, timeout=1800).check(f"{flavor} x {world}")
        results[(flavor, world)] = job.last_json()
    table = _table(results)
    print(table)
    if args.doc:
        harness.write_block(DOC, *MARKERS, table)


if __name__ == "__main__":
    main()
