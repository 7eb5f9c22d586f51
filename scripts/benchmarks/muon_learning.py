"""What Muon learns against AdamW: 200 steps of the debug model on the built-in corpus, 3 learning rates each.

    .venv/bin/python scripts/benchmarks/muon_learning.py          # ~15 minutes on 2 cores; a quiet machine
    .venv/bin/python scripts/benchmarks/muon_learning.py --doc    # also rewrites docs/benchmarks.md's table

Each run is the README's default job (``configs/llama3_debug.toml``: 2 processes, local batch 4 x 128, warmup 5,
cosine decay over the last half to 0.1) with ``--training.steps 200``, the optimizer and ``[optimizer] lr`` of its
row; Muon with ``muon_adjust_lr_fn = "match_rms_adamw"`` (the default, under which AdamW's rate transfers: its
``muon_lr`` is ``lr``) and Newton-Schulz in float32 (bfloat16 matmuls are ~50x slower on this CPU; the iteration is
the same). The table gives the training loss at the end (mean of the last 3 logged steps, every 10 steps) and the
held-out loss at the end; no threshold, only what was seen.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import harness

DOC = harness.DOCS / "benchmarks.md"
MARKERS = ("<!-- muon learning -->", "<!-- /muon learning -->")
LEARNING_RATES = (1.5e-3, 3e-3, 6e-3)
OPTIMIZERS = {"AdamW": (), "Muon": ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")}
STEPS = 200


def run(optimizer: str, lr: float, folder: Path) -> dict[str, float]:
    dump = folder / f"{optimizer}_{lr:g}"
    harness.launch(harness.TRAIN, "--config", "llama3_debug.toml", "--training.steps", str(STEPS),
                   "--metrics.log_freq", "10", "--metrics.enable_tensorboard=false", "--optimizer.lr", str(lr),
                   "--validation.enable", "--validation.freq", str(STEPS), "--validation.steps", "20",
                   "--job.dump_folder", str(dump), *OPTIMIZERS[optimizer], nproc=2, timeout=3600
                   ).check(f"{optimizer} lr {lr}")
    records = harness.read_metrics(dump)
    train = [r["loss_metrics/global_avg_loss"] for r in records if "loss_metrics/global_avg_loss" in r]
    held_out = [r["validation_metrics/loss"] for r in records if "validation_metrics/loss" in r]
    return {"train": statistics.fmean(train[-3:]), "held_out": held_out[-1]}


def table(results: dict[tuple[str, float], dict[str, float]]) -> str:
    lines = ["| optimizer | lr | training loss (last 3 logged) | held-out loss |", "|---|---:|---:|---:|"]
    best = {name: min(lr for (n, lr) in results if n == name and results[(n, lr)]["held_out"] == min(
        results[(m, x)]["held_out"] for (m, x) in results if m == name)) for name in OPTIMIZERS}
    for (name, lr), r in results.items():
        mark = " (best)" if best[name] == lr else ""
        lines.append(f"| {name} | {lr:g}{mark} | {r['train']:.4f} | {r['held_out']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", action="store_true", help="rewrite the table in docs/benchmarks.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = {(name, lr): run(name, lr, Path(folder)) for name in OPTIMIZERS for lr in LEARNING_RATES}
    text = table(results)
    print(text)
    if args.doc:
        harness.write_block(DOC, *MARKERS, text)


if __name__ == "__main__":
    main()
