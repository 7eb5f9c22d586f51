"""The dry run of a run with stages (``core/stages.py``): every stage's step priced, and the one that fits worst.

A stage that changes the global batch (more accumulation steps: the same activations, a longer step) or seq_len
(other activations, other attention cost) is another step. Each distinct (batch, seq_len) is priced as the
standalone dry run prices the config's first one, with the stage's values as the config's, in a fresh process of
its own (the layout search's workers, ``pricing_workers.py``: DTensor's caches allow one fake world per process).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from typing import Any

from titan_simple.config import JobConfig
from titan_simple.core.plan import RunPlan
from titan_simple.dry_run import pricing_workers
from titan_simple.dry_run.hardware import DeviceSpec


def price_stages(config: JobConfig, run: RunPlan, first: dict[str, Any], spec: DeviceSpec) -> dict[str, Any]:
    """``{"rows": [...], "worst": name}``: each stage's memory on the device, whether it fits, its tokens/s/GPU
    and MFU (``first``: the report of stage 0, already priced); the worst is the largest share of the device."""
    assert run.stages is not None
    base = dataclasses.replace(config, training=dataclasses.replace(config.training, stages=[]))
    later = sorted({(s.global_rows, s.seq_len) for s in run.stages.stages[1:]} - {(run.stages.stages[0].global_rows,
                                                                                   run.stages.stages[0].seq_len)})
    priced = {(run.stages.stages[0].global_rows, run.stages.stages[0].seq_len): first}
    if later:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["titan_simple.dry_run.pricing_workers"])
        device_type = "cpu" if config.dry_run.device == "cpu" else "cuda"
        with context.Pool(min(len(later), max(config.dry_run.search_workers, 1)), maxtasksperchild=1,
                          initializer=pricing_workers.start_worker,
                          initargs=(base, config.dry_run.world_size, device_type, spec)) as pool:
            overrides = [(("training.global_batch_size", str(rows)), ("training.seq_len", str(seq_len)))
                         for rows, seq_len in later]
            priced.update(zip(later, pool.map(pricing_workers.price, overrides, chunksize=1), strict=True))
    rows = []
    for stage in run.stages.stages:
        report = priced[(stage.global_rows, stage.seq_len)]
        if "error" in report:
            rows.append({"name": stage.name, "from_step": stage.start_step + 1, "error": report["error"]})
            continue
        memory = report["memory_bytes"]
        rows.append({"name": stage.name, "from_step": stage.start_step + 1, "global_batch": stage.global_rows,
                     "seq_len": stage.seq_len, "device_bytes": memory["device_total"],
                     "device_share": memory["device_total"] / memory["device"], "fits": report["fits"],
                     "tokens_per_second_per_gpu": report["tokens_per_second_per_gpu"], "mfu": report["mfu"],
                     "step_seconds": report["time_seconds"]["step"]})
    worst = max(rows, key=lambda r: float("inf") if "error" in r else r["device_share"])
    return {"rows": rows, "worst": worst["name"], "all_fit": all(r.get("fits", False) for r in rows)}


def stage_lines(stages: dict[str, Any]) -> list[str]:
    """The printed table of ``price_stages``."""
    lines = ["", f"  stages      {'from step':>9} {'batch':>7} {'seq_len':>8} {'on the device':>14} {'step':>10} "
             f"{'tokens/s/GPU':>13} {'MFU':>6}"]
    for r in stages["rows"]:
        if "error" in r:
            lines.append(f"    {r['name']:<10.10} {r['from_step']:>9}  refused: {r['error']}")
            continue
        fits = "" if r["fits"] else "  DOES NOT FIT"
        lines.append(f"    {r['name']:<10.10} {r['from_step']:>9} {r['global_batch']:>7} {r['seq_len']:>8} "
                     f"{100 * r['device_share']:>13.0f}% {r['step_seconds'] * 1e3:>8.0f}ms "
                     f"{r['tokens_per_second_per_gpu']:>13,.0f} {100 * r['mfu']:>5.1f}%{fits}")
    worst = next(r for r in stages["rows"] if r["name"] == stages["worst"])
    if "error" in worst:
        lines.append(f"  the stage that fits worst: {worst['name']}, refused at this layout")
    else:
        verdict = "" if worst["fits"] else ", DOES NOT FIT"
        lines.append(f"  the stage that fits worst: {worst['name']} ({100 * worst['device_share']:.0f}% of the "
                     f"device{verdict})")
    return lines
