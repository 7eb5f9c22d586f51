"""The dry run's printed table: ``format_report`` turns the report of ``prediction.build_report`` into text."""

from __future__ import annotations

import json
import os
from typing import Any

from titan_simple.dry_run.hardware import GIB
from titan_simple.dry_run.stage_plans import stage_lines


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _memory_lines(r: dict[str, Any]) -> list[str]:
    """The memory block: each part, the peak, what the allocator and the runtime add, and whether it fits."""
    m = r["memory_bytes"]
    lines = [
        "",
        "  memory per rank            ",
        f"    parameters (fp32 shards)  {_gib(m['parameters']):>14}",
        f"    gradients                 {_gib(m['gradients']):>14}",
        f"    optimizer state           {_gib(m['optimizer_state']):>14}",
        f"    activations               {_gib(m['activations']):>14}   "
        f"({_gib(m['activations_per_microbatch'])} per microbatch)",
        f"    transient                 {_gib(m['transient']):>14}",
        f"    peak (tensors)            {_gib(m['peak']):>14}   (reached at {r['peak_at']})",
    ]
    if m["device_total"] != m["peak"]:
        lines += [
            f"    reserved (allocator)      {_gib(m['reserved']):>14}   "
            f"(peak x {m['reserved'] / m['peak']:.3f}, fitted)",
            f"    + CUDA context, NCCL      {_gib(m['device_total'] - m['reserved']):>14}",
        ]
    lines.append(f"    on the device             {_gib(m['device_total']):>14}   of {_gib(m['device'])} "
                 f"({100 * m['device_total'] / m['device']:.0f}%)  -> {'fits' if r['fits'] else 'DOES NOT FIT'}")
    if not r["fits"]:
        lines.append(f"    largest contributor: {r['largest_contributor']}; suggestion: {r['suggestion']}")
    return lines


def _time_lines(r: dict[str, Any]) -> list[str]:
    """The step-time block (roofline) and the predicted tokens/s and MFU."""
    ts = r["time_seconds"]
    if r.get("async_tensor_parallel"):
        tp_line = (f"    tensor-parallel/other comm {ts['tensor_parallel_and_other_comm'] * 1e3:>10.1f} ms "
                   f"({ts['tensor_parallel_and_other_comm_exposed'] * 1e3:.1f} ms exposed; async TP fuses "
                   f"{r['async_tensor_parallel']['fused_collectives_per_pass']} per microbatch pass)")
    else:
        tp_line = (f"    tensor-parallel/other comm {ts['tensor_parallel_and_other_comm_exposed'] * 1e3:>10.1f} ms "
                   "(exposed)")
    return [
        "",
        "  step time (roofline)",
        f"    compute                    {ts['compute'] * 1e3:>10.1f} ms (matmul {ts['compute_matmul'] * 1e3:.0f}, "
        f"attention {ts['compute_attention'] * 1e3:.0f}, elementwise {ts['compute_elementwise'] * 1e3:.0f})",
        f"    data-parallel comm         {ts['data_parallel_comm'] * 1e3:>10.1f} ms "
        f"({ts['data_parallel_comm_exposed'] * 1e3:.1f} ms exposed)",
        tp_line,
        f"    pipeline send/recv         {ts['pipeline_send_recv'] * 1e3:>10.1f} ms",
        f"    pipeline bubble            {ts['pipeline_bubble'] * 1e3:>10.1f} ms",
        f"    optimizer step             {ts['optimizer'] * 1e3:>10.1f} ms{_muon_note(r)}",
        f"    step                       {ts['step'] * 1e3:>10.1f} ms",
        f"  roofline: {r['roofline_tokens_per_second_per_gpu']:,.0f} tokens/s/GPU; predicted (x "
        f"{r['tokens_per_second_per_gpu'] / r['roofline_tokens_per_second_per_gpu']:.3f}, fitted): "
        f"{r['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, MFU {100 * r['mfu']:.1f}%  "
        f"(traced in {r['trace_seconds']:.1f} s)",
    ]


def format_report(r: dict[str, Any]) -> str:
    """The dry run's report as the console shows it."""
    pipe = r["pipeline"]
    lines = [*r.get("plan", []), "",
        f"dry run: llama3 {r['model']} ({r['parameters'] / 1e9:.2f}B params) on {r['world_size']} x {r['device']}, "
        f"mesh {r['mesh']}, rank {r['rank']}",
        f"  local batch {r['local_batch_size']} x seq {r['seq_len']}, AC {r['activation_checkpoint']}, "
        f"{'compiled' if r['compiled'] else 'eager'}, data-parallel comm "
        f"{'overlapped' if r['comm_overlapped'] else 'exposed'}, "
        f"SimpleFSDP gathers {r['fsdp_gather'].replace('_', ' ')}",
    ]
    if pipe:
        lines.append(f"  pipeline {pipe['schedule']}: {pipe['stages']} stages, this rank runs {pipe['local_stages']}, "
                     f"{pipe['microbatches']} microbatches, {pipe['in_flight_chunks']} in flight at the peak")
    lines += _memory_lines(r)
    lines += ["", f"  collectives per step (mesh dim(size, link) kind dtype)   {'count':>7} {'bucketed':>8} "
              f"{'payload':>14} {'time':>10}"]
    for c in r["collectives_per_step"]:
        label = f"{c['mesh_dim']}({c['size']},{c['link']}) {c['kind']} {c['dtype']}"
        lines.append(f"    {label:<52} {c['count']:>7} {c['count_bucketed']:>8} {_gib(c['bytes']):>14} "
                     f"{c['seconds'] * 1e3:>8.1f}ms")
    lines += _time_lines(r)
    if "stages" in r:
        lines += stage_lines(r["stages"])
    return "\n".join(lines)


def write_json(folder: str, name: str, data: dict[str, Any]) -> None:
    """``data`` as ``folder/name`` (the dump folder's dry_run.json or search.json), and a line saying where."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"  written: {path}", flush=True)


def _muon_note(report: dict) -> str:
    muon = report.get("muon")
    if not muon:
        return ""
    return (f" (Muon: Newton-Schulz {muon['seconds'] * 1e3:.1f} ms on the slowest of {muon['owners']} owners of "
            f"{muon['matrices']} matrices, {muon['imbalance']:.2f}x the mean)")
