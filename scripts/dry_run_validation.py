"""Dry-run predictions for the published Llama 3 runs, side by side with the published figures.

    python scripts/dry_run_validation.py [--json FILE]      # ~5-10 minutes on 2 CPU cores, one process per run

Each case runs ``train.py --dry_run`` with the overrides that match the published setting as closely as our
configs allow, and prints a markdown table: predicted vs published memory (the allocator's reserved peak, as
published) and tokens/s/GPU, with the error. The GPU constants of planning/hardware.py were fitted on the case
marked "fit"; every other case is held out. The published figures and their settings are in docs/dry_run.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

FLOAT8 = ("--model.converters", "float8")
# TorchTitan's published runs (Dec 2024, and the async-TP runs of 2025-06) computed cross_entropy on the whole
# [tokens, vocab] fp32 logits, eagerly (its loss was not compiled): our plain loss (loss_chunks 1). It matters for
# memory where the loss runs eagerly in our trainer too (eager runs, and tensor parallel's loss parallel).
PLAIN_LOSS = ("--training.loss_chunks", "1")
BF16_GATHER = ("--float8.all_gather", "false")
# (name, train.py arguments, published tokens/s/GPU (low, high), published memory GiB (low, high) or None)
CASES: list[tuple[str, list[str], tuple[float, float] | None, tuple[float, float] | None]] = [
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, eager",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--compile.enable", "false", "--dry_run.comm_overlap", "overlapped", *PLAIN_LOSS], (5762, 5762), (77, 82)),
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, compiled",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped"], (6667, 6667), (77, 82)),
    ("SimpleFSDP 8B, 8 H100, FSDP8, lbs 1, compiled + bucketing/reorder",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--compile.bucketing", "transformer_block",
      "--compile.reorder", "true"], (7227, 7227), (40.96, 40.96)),  # FIT_CASE
    ("FSDP2 8B, 8 H100, FSDP8, lbs 1 (SimpleFSDP paper's baseline)",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--dry_run.comm_overlap", "overlapped"],
     (7380, 7380), (47.82, 47.82)),
    ("TorchTitan 70B, 256 H100, FSDP32 x TP8, lbs 16, full AC (bf16 counterpart of a float8 run: not like for like)",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", *PLAIN_LOSS], (829, 829), (71.9, 71.9)),
    ("70B as above + async TP (bf16 counterpart of a float8 run: not like for like)",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", "--parallelism.enable_async_tensor_parallel", *PLAIN_LOSS], (876, 876),
     (67.6, 67.6)),
    ("TorchTitan 405B, 512 H100, FSDP8 x TP8 x PP8, Interleaved 1F1B, lbs 32, async TP (shipped config; "
     "bf16 counterpart of a float8 run: not like for like)",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", *PLAIN_LOSS], (128, 128), (72.7, 72.7)),
    ("405B as above with 1F1B (one stage per rank; bf16 counterpart of a float8 run: not like for like)",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", "--parallelism.pipeline_parallel_schedule",
      "1F1B", *PLAIN_LOSS], (100, 100), (82.5, 82.5)),
    ("405B Interleaved 1F1B without async TP",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512",
      "--parallelism.enable_async_tensor_parallel", "false", *PLAIN_LOSS], (128, 128), (72.7, 72.7)),
    ("405B Interleaved 1F1B, gathering per microbatch (fsdp_gather = per_microbatch), dp comm exposed",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", "--parallelism.fsdp_gather", "per_microbatch"],
     (128, 128), (72.7, 72.7)),
    # Float8 (issue 31): TorchTitan's published float8 runs (benchmarks/llama3_h100_202412_torchtitan.md and
    # asyncTP_llama3_h100_2025-06_torchtitan.md), tensorwise, our float8 all-gather on (the default).
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, compiled, float8",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped", *FLOAT8], (8532, 8532), (76.8, 76.8)),  # FLOAT8_FIT_CASE
    ("TorchTitan 70B, 256 H100, FSDP32 x TP8, lbs 16, full AC, float8",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", *FLOAT8, *PLAIN_LOSS], (810, 810), (71.9, 71.9)),
    ("70B as above + async TP, float8",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", "--parallelism.enable_async_tensor_parallel", *FLOAT8, *PLAIN_LOSS],
     (942, 942), (67.6, 67.6)),
    ("405B shipped config (Interleaved 1F1B, async TP, lbs 32), float8",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", *FLOAT8, *PLAIN_LOSS], (128, 128),
     (72.7, 72.7)),
    # The same float8 runs with the weights gathered in bf16: what gathering them in float8 changes.
    ("8B float8 as above, weights gathered in bf16",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped", *FLOAT8, *BF16_GATHER], (8532, 8532), (76.8, 76.8)),
    ("70B float8 + async TP as above, weights gathered in bf16",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", "--parallelism.enable_async_tensor_parallel", *FLOAT8, *BF16_GATHER],
     (942, 942), None),
    ("405B float8 as above, weights gathered in bf16",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", *FLOAT8, *BF16_GATHER], (128, 128),
     (72.7, 72.7)),
    ("405B shipped config with 1F1B (one stage per rank), float8",
     ["--config", "llama3_405b.toml", "--dry_run.world_size", "512", "--parallelism.pipeline_parallel_schedule",
      "1F1B", *FLOAT8, *PLAIN_LOSS], (100, 100), (82.5, 82.5)),
]

FIT_CASE = 2  # the constants of planning/hardware.py were fitted on this case alone
FLOAT8_FIT_CASE = 10  # ... but the float8 GEMM efficiency, fitted on this one


def run_case(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "train.py", "--dry_run", "--job.dump_folder", folder, *args],
                       cwd=PROJECT_DIR, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(folder) / "dry_run.json").read_text())


def error(predicted: float, low: float, high: float) -> str:
    if low <= predicted <= high:
        return "within"
    target = low if predicted < low else high
    return f"{100 * (predicted / target - 1):+.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    print("| case | | tensor peak GiB | reserved GiB predicted | published | error | roofline tokens/s/GPU | "
          "predicted | published | error | MFU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, (name, case_args, tps, mem) in enumerate(CASES):
        r = run_case(case_args)
        results.append({"case": name, "args": case_args, "report": r})
        peak, reserved = (r["memory_bytes"][k] / 2**30 for k in ("peak", "reserved"))
        t = r["tokens_per_second_per_gpu"]
        mem_pub = "-" if mem is None else (f"{mem[0]:g}" if mem[0] == mem[1] else f"{mem[0]:g}-{mem[1]:g}")
        mem_err = "-" if mem is None else error(reserved, *mem)
        tps_pub = f"{tps[0]:,.0f}" if tps[0] == tps[1] else f"{tps[0]:,.0f}-{tps[1]:,.0f}"
        role = "fit" if index == FIT_CASE else "fit (float8 GEMMs)" if index == FLOAT8_FIT_CASE else "held out"
        print(f"| {name} | {role} | {peak:.1f} | {reserved:.1f} | {mem_pub} | {mem_err} | "
              f"{r['roofline_tokens_per_second_per_gpu']:,.0f} | {t:,.0f} | {tps_pub} | {error(t, *tps)} | "
              f"{100 * r['mfu']:.1f}% |", flush=True)
    fit = results[FIT_CASE]["report"]
    print(f"\nfit check: published / roofline = {CASES[FIT_CASE][2][0] / fit['roofline_tokens_per_second_per_gpu']:.3f}"
          f" (achieved_fraction {fit['device_spec']['achieved_fraction']}), published / tensor peak - 1 = "
          f"{CASES[FIT_CASE][3][0] * 2**30 / fit['memory_bytes']['peak'] - 1:.3f} (allocator_overhead "
          f"{fit['device_spec']['allocator_overhead']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
