"""Dry-run predictions for the published Llama 3 runs, side by side with the published figures.

    python scripts/benchmarks/dry_run_validation.py [--json FILE]  # ~5-10 minutes on 2 CPU cores, one process per run

Each case runs ``train.py --dry_run`` with the overrides that match the published setting as closely as our
configs allow, and prints a markdown table: predicted vs published memory (the allocator's reserved peak, as
published) and tokens/s/GPU, with the error. The GPU constants of dry_run/hardware.py were fitted on the case
marked "fit"; every other case is held out. The published figures and their settings are in docs/dry_run.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import harness

FLOAT8 = ("--model.converters", "float8")
# TorchTitan's published runs (Dec 2024, and the async-TP runs of 2025-06) computed cross_entropy on the whole
# [tokens, vocab] fp32 logits, eagerly (its loss was not compiled): our plain loss (loss_chunks 1). It matters for
# memory where the loss runs eagerly in our trainer too (eager runs, and tensor parallel's loss parallel).
PLAIN_LOSS = ("--training.loss_chunks", "1")
BF16_GATHER = ("--float8.all_gather", "false")
# TorchTitan's published 405B runs (Table 5 of benchmarks/llama3_h100_202412_torchtitan.md, torchtitan 9dec370) set
# no pipeline_parallel_microbatches, whose default then was the pipeline degree: local batch 32 ran as 8 microbatches
# of 4 sequences under both schedules (their 1F1B / Interleaved 1F1B ratio, 100 / 128, is that bubble's). Our
# shipped config runs 32 microbatches of 1 instead: its rows have no published figure.
TT_405B = ("--config", "llama3_405b.toml", "--dry_run.world_size", "512",
           "--parallelism.pipeline_parallel_microbatch_size", "4", *PLAIN_LOSS)
SHIPPED_405B = ("--config", "llama3_405b.toml", "--dry_run.world_size", "512", *PLAIN_LOSS)
ONE_F_ONE_B = ("--parallelism.pipeline_parallel_schedule", "1F1B")
# (name, train.py arguments, published tokens/s/GPU (low, high) or None, published memory GiB (low, high) or None)
CASES: list[tuple[str, list[str], tuple[float, float] | None, tuple[float, float] | None]] = [
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, eager",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--compile.enable", "false", "--dry_run.comm_overlap", "overlapped", *PLAIN_LOSS], (5762, 5762), (77, 82)),
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, compiled",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped"], (6667, 6667), (77, 82)),
    ("SimpleFSDP 8B, 8 H100, FSDP8, lbs 1, compiled + bucketing/reorder",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--compile.bucketing", "transformer_block",
      "--compile.reorder", "true"], (7227, 7227), (40.96, 40.96)),
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
    ("TorchTitan 405B, 512 H100, FSDP8 x TP8 x PP8, Interleaved 1F1B, lbs 32 as 8 microbatches of 4, full AC, "
     "async TP (bf16 counterpart of a float8 run: not like for like)", [*TT_405B], (128, 128), (72.7, 72.7)),
    ("405B as above with 1F1B (one stage per rank; bf16 counterpart of a float8 run: not like for like)",
     [*TT_405B, *ONE_F_ONE_B], (100, 100), (82.5, 82.5)),
    ("405B shipped config: Interleaved 1F1B, 32 microbatches of 1 (not published)", [*SHIPPED_405B], None, None),
    ("405B shipped config without async TP (not published)",
     [*SHIPPED_405B, "--parallelism.enable_async_tensor_parallel", "false"], None, None),
    ("405B shipped config, gathering per microbatch (fsdp_gather = per_microbatch), dp comm exposed (not published)",
     [*SHIPPED_405B, "--parallelism.fsdp_gather", "per_microbatch"], None, None),
    # Float8: TorchTitan's published float8 runs (benchmarks/llama3_h100_202412_torchtitan.md and
    # asyncTP_llama3_h100_2025-06_torchtitan.md), tensorwise, our float8 all-gather on (the default).
    ("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, compiled, float8",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped", *FLOAT8], (8532, 8532), (76.8, 76.8)),
    ("TorchTitan 70B, 256 H100, FSDP32 x TP8, lbs 16, full AC, float8",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", *FLOAT8, *PLAIN_LOSS], (810, 810), (71.9, 71.9)),
    ("70B as above + async TP, float8",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", "--parallelism.enable_async_tensor_parallel", *FLOAT8, *PLAIN_LOSS],
     (942, 942), (67.6, 67.6)),
    ("TorchTitan 405B as published: Interleaved 1F1B, 8 microbatches of 4, async TP, float8", [*TT_405B, *FLOAT8],
     (128, 128), (72.7, 72.7)),
    ("405B as published with 1F1B (one stage per rank), float8", [*TT_405B, *ONE_F_ONE_B, *FLOAT8], (100, 100),
     (82.5, 82.5)),
    # The same float8 runs with the weights gathered in bf16: what gathering them in float8 changes.
    ("8B float8 as above, weights gathered in bf16",
     ["--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "2",
      "--dry_run.comm_overlap", "overlapped", *FLOAT8, *BF16_GATHER], (8532, 8532), (76.8, 76.8)),
    ("70B float8 + async TP as above, weights gathered in bf16",
     ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--dry_run.comm_overlap", "overlapped",
      "--training.local_batch_size", "16", "--parallelism.enable_async_tensor_parallel", *FLOAT8, *BF16_GATHER,
      *PLAIN_LOSS], (942, 942), None),
    ("405B float8 Interleaved 1F1B as published, weights gathered in bf16 (not published: TorchTitan's 405B config "
     "gathered them in float8)", [*TT_405B, *FLOAT8, *BF16_GATHER], None, None),
    ("405B shipped config (32 microbatches of 1), float8 (not published)", [*SHIPPED_405B, *FLOAT8], None, None),
    # Context parallel: TorchTitan's docs/performance.md Table 2 (FSDP + CP + torch.compile + float8, Llama 3.1 8B,
    # 8 H100 at 500 W, local batch 1, full AC; seq 32K x FSDP8 ... 256K x CP8). Its CP was torch's ring attention
    # over SDPA, causal; ours all-gathers keys and values for FlexAttention: not like for like (docs/dry_run.md).
    *((f"TorchTitan 8B context parallel, 8 H100, FSDP{8 // cp} x CP{cp}, seq {32768 * cp}, lbs 1, full AC, float8 "
       "(ring-attention CP: not like for like)",
       ["--config", "llama3_8b_128k.toml", "--dry_run.world_size", "8", "--training.seq_len", str(32768 * cp),
        "--parallelism.context_parallel_degree", str(cp), "--model.attention_mask", "causal",
        "--activation_checkpoint.mode", "full", *FLOAT8, *PLAIN_LOSS], (tps, tps), (mem, mem))
      for cp, tps, mem in ((1, 3890, 83.9), (2, 2540, 84.2), (4, 1071, 84.0), (8, 548, 84.5))),
]

NAMES = [case[0] for case in CASES]
FIT_CASE = NAMES.index("SimpleFSDP 8B, 8 H100, FSDP8, lbs 1, compiled + bucketing/reorder")  # hardware.py's fit
FLOAT8_FIT_CASE = NAMES.index("TorchTitan 8B, 8 H100, FSDP8, lbs 2, selective AC, compiled, float8")  # float8 GEMMs


def run_case(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        harness.launch(harness.TRAIN, "--dry_run", "--job.dump_folder", folder, *args, env=os.environ).check(
            f"train.py --dry_run {' '.join(args)}")
        return json.loads((Path(folder) / "dry_run.json").read_text())


def error(predicted: float, low: float, high: float) -> str:
    if low <= predicted <= high:
        return "within"
    target = low if predicted < low else high
    return f"{100 * (predicted / target - 1):+.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = parser.parse_args()
    results = []
    print("| case | | tensor peak GiB | reserved GiB predicted | published | error | roofline tokens/s/GPU | "
          "predicted | published | error | MFU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, (name, case_args, tps, mem) in enumerate(CASES):
        if args.only not in name:
            continue
        r = run_case(case_args)
        results.append({"case": name, "args": case_args, "report": r})
        peak, reserved = (r["memory_bytes"][k] / 2**30 for k in ("peak", "reserved"))
        t = r["tokens_per_second_per_gpu"]
        mem_pub = "-" if mem is None else (f"{mem[0]:g}" if mem[0] == mem[1] else f"{mem[0]:g}-{mem[1]:g}")
        mem_err = "-" if mem is None else error(reserved, *mem)
        tps_err = "-" if tps is None else error(t, *tps)
        tps_pub = "-" if tps is None else f"{tps[0]:,.0f}" if tps[0] == tps[1] else f"{tps[0]:,.0f}-{tps[1]:,.0f}"
        role = ("fit" if index == FIT_CASE else "fit (float8 GEMMs)" if index == FLOAT8_FIT_CASE
                else "held out" if tps or mem else "-")
        print(f"| {name} | {role} | {peak:.1f} | {reserved:.1f} | {mem_pub} | {mem_err} | "
              f"{r['roofline_tokens_per_second_per_gpu']:,.0f} | {t:,.0f} | {tps_pub} | {tps_err} | "
              f"{100 * r['mfu']:.1f}% |", flush=True)
    if args.only:
        return
    fit = results[FIT_CASE]["report"]
    print(f"\nfit check: published / roofline = {CASES[FIT_CASE][2][0] / fit['roofline_tokens_per_second_per_gpu']:.3f}"
          f" (achieved_fraction {fit['device_spec']['achieved_fraction']}), published / tensor peak - 1 = "
          f"{CASES[FIT_CASE][3][0] * 2**30 / fit['memory_bytes']['peak'] - 1:.3f} (allocator_overhead "
          f"{fit['device_spec']['allocator_overhead']})")
    if args.json:
        harness.save_json(args.json, results)


if __name__ == "__main__":
    main()
