"""The layout search's printed table (``search.py``) and the one reason each runner-up loses."""

from __future__ import annotations

from typing import Any

# The step's parts a runner-up can lose on, and what to call them.
PARTS = {
    "compute": "compute",
    "data_parallel_comm_exposed": "exposed data-parallel comm",
    "tensor_parallel_and_other_comm_exposed": "exposed tensor-parallel comm",
    "pipeline_send_recv": "pipeline send/recv",
    "pipeline_bubble": "pipeline bubble",
    "optimizer": "optimizer step",
}


def why_loses(row: dict[str, Any], best: dict[str, Any]) -> str:
    """The part of the step that costs ``row`` most against ``best`` (both process the same tokens per step)."""
    t, b = row["time_seconds"], best["time_seconds"]
    deltas = {name: t[key] - b[key] for key, name in PARTS.items()}
    name = max(deltas, key=deltas.__getitem__)
    why = f"+{1000 * deltas[name]:,.0f} ms {name}"
    if name == "compute" and row["activation_checkpoint"] != best["activation_checkpoint"]:
        why += f" (AC {row['activation_checkpoint']} recomputes)"
    return why


# Features a row may use that have never run on a GPU: marked in the table (and explained under it).
NEVER_RUN_ON_A_GPU = "*"


def describe(row: dict[str, Any], batch: str | None = None) -> str:
    """A short name of a row's layout: every setting the search chooses (``batch``: the global batch, when the
    search changed the config's)."""
    parts = [row["mesh"], f"lbs {row['local_batch_size']}"]
    pipe = row["pipeline"]
    if pipe:
        parts.append(f"{pipe['schedule']} x {pipe['microbatches']} mb")
    parts.append(f"AC {row['activation_checkpoint'].replace(' (op)', '')}")
    if row["fsdp_gather"] == "once_per_step":
        parts.append("gather once/step")
    if "model.converters" in row["layout"] and "--model.converters float8" in row["layout"]:
        parts.append("float8")
    if row.get("async_tensor_parallel"):
        parts.append(f"async TP{NEVER_RUN_ON_A_GPU}")
    if batch is not None:
        parts.append(f"global batch {batch}")
    return ", ".join(parts)


def _batch(row: dict[str, Any], config_batch: str | None) -> str | None:
    """The row's global batch when it is not the config's."""
    overrides = row.get("overrides", [])
    if "--training.global_batch_size" not in overrides:
        return None
    batch = overrides[overrides.index("--training.global_batch_size") + 1]
    return batch if batch != config_batch else None


def format_search(result: dict[str, Any]) -> str:
    table, published = result["table"], result["published"]
    headroom = result["memory_headroom"]
    config_batch = result.get("config_global_batch")
    lines = [
        f"layout search: llama3 {result['model']} on {result['world_size']} x {result['device']} "
        f"({result['gpus_per_node']} per node): {result['layouts']:,} layouts, {len(result['priced'])} priced by the "
        f"dry run in {result['seconds']:.0f} s; recommended: its planned memory could grow {headroom:.0%} and fit "
        "(the dry run's error)",
        f"  {'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'reserved':>10} {'room':>5} {'exposed comm':>12} {'bubble':>8}  "
        "layout (why not #1)",
    ]
    for rank, row in enumerate(table, 1):
        why = f"  ({row['why_not_first']})" if rank > 1 else ""
        same = (row["tokens_per_second_per_gpu"], row["reserved_gib"]) == (
            published.get("tokens_per_second_per_gpu"), published.get("reserved_gib"))
        mark = "  <- the config as written" if same else ""
        lines.append(f"  {rank:>3} {row['tokens_per_second_per_gpu']:>12,.0f} {100 * row['mfu']:>5.1f}% "
                     f"{row['reserved_gib']:>6.1f} GiB {100 * row['headroom']:>+4.0f}% "
                     f"{row['exposed_comm_seconds']:>10.2f} s {row['bubble_seconds']:>6.2f} s  "
                     f"{describe(row, _batch(row, config_batch))}{why}{mark}")
    if any(row.get("async_tensor_parallel") for row in table):
        lines.append(f"  {NEVER_RUN_ON_A_GPU} async tensor parallel has never run on a GPU here: prefer the best row "
                     "without it until a GPU run confirms it")
    if "error" in published:
        lines.append(f"  the config as written: not valid on this world ({published['error']})")
    else:
        fits = ("recommended" if published["recommended"] else
                f"fits, but its memory could grow only {published['headroom']:.0%}" if published["fits"] else
                "does not fit")
        why = f"; {published['why_not_first']}" if published.get("why_not_first") else ""
        place = (f"rank {published['rank']}" if published["recommended"] else
                 f"would rank {published['rank']} among the recommended")
        lines.append(f"  the config as written ({describe(published)}): {place}, "
                     f"{published['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, {published['reserved_gib']:.1f} "
                     f"GiB reserved, {fits}{why}")
    tight = result["tight"]
    if tight["count"]:
        lines.append(f"  not recommended: {tight['count']} priced layouts fit with less room than {headroom:.0%} "
                     f"(the fastest {tight['fastest']:,.0f} tokens/s/GPU; search.json lists them)")
    unpriced = result["unpriced"]
    if unpriced["count"]:
        limit = ("the --dry_run.search_seconds limit" if unpriced["time_limited"] else
                 f"the count of {unpriced['budget']} (--dry_run.search_layouts)")
        lines.append(f"  {unpriced['count']:,} candidates left unpriced by {limit}, ceilings up to "
                     f"{unpriced['highest_ceiling']:,.0f} tokens/s/GPU; raise it to price more")
    lines.append("  candidates: " + ", ".join(f"{n:,} {fate}" for fate, n in sorted(result["fates"].items(),
                                                                              key=lambda item: -item[1])))
    lines.append(f"  the fastest, to paste: {' '.join(table[0]['overrides'])}")
    lines.append("  Predictions of the dry run (held-out errors of its calibration: docs/dry_run.md); only a GPU run "
                 "confirms them.")
    return "\n".join(lines)

