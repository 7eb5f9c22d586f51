"""What checkpoint averaging holds in memory: ``scripts/average_checkpoints.py --last 3`` on three saves of the
debug model and of ``debugmodel_large``, its peak RSS against one fp32 copy of the model.

    .venv/bin/python scripts/benchmarks/benchmark_average.py [--doc]

The saves are written here (random weights, seeds 1, 2, 3, as a run's step folders with their complete.json);
the averaging runs as its own process, as a user runs it, and reports its peak RSS and its own memory at its
largest (anonymous memory sampled after each weight and after the save, above what it held when averaging
began: the process's RSS also counts the pages of the libraries it maps, as many as the page cache holds).
``--doc`` writes the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import harness

DOC = harness.DOCS / "benchmarks.md"
MARKERS = ("<!-- average table -->", "<!-- /average table -->")
FLAVORS = ("debugmodel", "debugmodel_large")
LINE = re.compile(r"peak RSS ([\d.]+) MiB; the averaging's own memory ([\d.]+) MiB at its largest, one fp32 copy "
                  r"of the model ([\d.]+) MiB")


def write_saves(folder: Path, flavor: str) -> None:
    """Three step folders of ``flavor`` with random weights, as a run writes them."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer

    args = LLAMA3_FLAVORS[flavor]
    for step in (1, 2, 3):
        torch.manual_seed(step)
        path = folder / f"step-{step}"
        dcp.save({"model": Transformer(args).state_dict()}, checkpoint_id=str(path), no_dist=True)
        (path / "complete.json").write_text(json.dumps({"step": step, "model_only": False,
                                                        "model_args": dataclasses.asdict(args)}))


def measure(flavor: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "checkpoint"
        write_saves(folder, flavor)
        start = time.perf_counter()
        job = harness.launch("scripts/average_checkpoints.py", "--checkpoint_folder", folder, "--last", "3")
        job.check(f"averaging three saves of {flavor}")
        seconds = time.perf_counter() - start
    match = LINE.search(job.stdout)
    if match is None:
        raise SystemExit(f"average_checkpoints.py printed no memory line: {job.stdout[-500:]}")
    peak, added, one_copy = (float(g) for g in match.groups())
    return {"peak": peak, "added": added, "one_copy": one_copy, "seconds": seconds}


def table(results: dict[str, dict[str, float]]) -> str:
    rows = ["| model | one fp32 copy (MiB) | peak RSS of the process (MiB) | the averaging's own memory (MiB) | "
            "own / one copy | seconds (with start-up) |", "|---|---:|---:|---:|---:|---:|"]
    for flavor, r in results.items():
        rows.append(f"| {flavor} | {r['one_copy']:.1f} | {r['peak']:.1f} | {r['added']:.1f} | "
                    f"{r['added'] / r['one_copy']:.2f}x | {r['seconds']:.1f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    results = {flavor: measure(flavor) for flavor in FLAVORS}
    text = table(results)
    print(text)
    if args.doc:
        harness.write_block(DOC, *MARKERS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
