"""``--dry_run --dry_run.search``: rank every layout of a model on a cluster by the dry run's prediction.

    python train.py --config llama3_70b.toml --dry_run --dry_run.search --dry_run.world_size 256

1. ``layouts.enumerate_layouts``: every mix of the trainer's knobs at the config's global batch, checked later
   by the trainer's own ``resolve_plan``.
2. Pruned without tracing: pins (``search_fix``), layouts the model can never rank above a sibling
   (``layouts.dominated``), and layouts whose ``bounds.memory_floor`` does not fit.
3. One block per class of (replication, tensor parallel, microbatch, activation checkpointing, float8,
   gathering), traced at 1 and 2 blocks, gives each layout its ``bounds.speed_ceiling``.
4. Best first: layouts are priced in order of their ceiling by the standalone dry run itself (``pricing_workers``,
   a fresh process per layout), until ``search_top`` recommended layouts are faster than every ceiling left or
   ``search_layouts`` are priced (a count: results are taken in the order they were asked for, so the table does
   not depend on the machine's load; ``search_seconds`` adds an optional time limit). A heavier activation
   checkpointing of a layout whose lighter one is recommended is skipped (it only adds recomputation).
5. Recommended: a layout that fits with ``memory_headroom`` to spare (the dry run's own error against published
   runs); one that fits with less is counted, never ranked.
6. The table (``search_printout``) and ``search.json``: every candidate with its fate.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from typing import Any

from titan_simple.config import JobConfig
from titan_simple.dry_run import pricing_workers
from titan_simple.dry_run.bounds import (
    ADAM_BYTES_PER_PARAMETER,
    ModelSizes,
    data_parallel_floor,
    memory_floor,
    speed_ceiling,
)
from titan_simple.dry_run.hardware import GIB, DeviceSpec, planned_device
from titan_simple.dry_run.layouts import (
    Layout,
    apply_overrides,
    checked_plan,
    dominated,
    enumerate_layouts,
    global_rows,
    matches,
    model_of,
)
from titan_simple.dry_run.printout import write_json
from titan_simple.dry_run.search_printout import format_search, why_loses
from titan_simple.errors import ConfigError

AC_ORDER = {"none": 0, "selective": 1, "full": 2}


def parse_pins(config: JobConfig) -> dict[str, str]:
    """``[dry_run] search_fix`` as {section.key: value}, each checked as a command-line override would be."""
    pins = {}
    for pin in config.dry_run.search_fix:
        key, eq, value = pin.partition("=")
        if not eq or "." not in key:
            raise ConfigError(f"[dry_run] search_fix: '{pin}' is not section.key=value; e.g. "
                              "--dry_run.search_fix parallelism.tensor_parallel_degree=8")
        apply_overrides(config, [(key.strip(), value.strip())])  # unknown keys / bad values: one line
        pins[key.strip()] = value.strip()
    return pins


def _class_overrides(layout: Layout, world_size: int) -> tuple[tuple[str, str], ...]:
    """A pipeline-free layout whose blocks cost no more than ``layout``'s: the same tensor parallel, microbatch,
    checkpointing, float8, gathering and replication, with every other data-parallel rank a shard (SimpleFSDP's
    casts and views act on the local shards: the most shards, the least of them)."""
    values = layout.values
    tp, cp = layout.degree("tensor_parallel"), layout.degree("context_parallel")
    pp = layout.degree("pipeline_parallel")
    micro = values["parallelism.pipeline_parallel_microbatch_size"] if pp > 1 else values["training.local_batch_size"]
    dp = world_size // (tp * cp)
    replicated = layout.degree("data_parallel_shard") == 1 and cp == 1
    gather = values["parallelism.fsdp_gather"]
    steps = 2 if gather == "once_per_step" else 1  # gathering once per step needs several microbatches
    keep = ("parallelism.context_parallel_degree", "model.attention", "parallelism.enable_async_tensor_parallel",
            "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option", "compile.enable",
            "model.converters")
    return (("parallelism.data_parallel_replicate_degree", str(dp if replicated else 1)),
            ("parallelism.data_parallel_shard_degree", str(1 if replicated else dp)),
            ("parallelism.tensor_parallel_degree", str(tp)), ("parallelism.pipeline_parallel_degree", "1"),
            ("parallelism.fsdp_gather", gather), ("training.local_batch_size", micro),
            ("training.global_batch_size", str(int(micro) * dp * steps)), ("compile.regional", "false"),
            *((k, values[k]) for k in keep if k in values))


# The default of [dry_run] memory_headroom: the dry run's largest under-prediction of a published run's reserved
# memory among the like-for-like cases (-16%, TorchTitan 8B lbs 2 compiled: 65.1 vs 77-82 GiB; docs/dry_run.md).
MEASURED_MEMORY_ERROR = 0.16


def layout_budget(layouts: int, world_size: int) -> int:
    """``[dry_run] search_layouts``; 0: 24 up to 64 GPUs, 100 above (on a quiet 2-core CPU about a minute, and
    about four minutes at 256 or 512 GPUs)."""
    return layouts if layouts > 0 else 24 if world_size <= 64 else 100


def memory_headroom(setting: float) -> float:
    return MEASURED_MEMORY_ERROR if setting < 0 else setting


def _sibling_key(layout: Layout) -> tuple:
    return tuple((k, v) for k, v in layout.overrides
                 if k not in ("activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"))


def _row(layout: Layout | None, report: dict[str, Any], headroom: float, spec) -> dict[str, Any]:
    """A priced layout's line of search.json. ``headroom``: the free fraction of its planned device memory a
    recommended layout keeps."""
    t = report["time_seconds"]
    spare = spec.memory_bytes / report["memory_bytes"]["device_total"] - 1
    return {
        "headroom": spare, "recommended": bool(report["fits"]) and spare >= headroom,
        "async_tensor_parallel": bool(report.get("async_tensor_parallel")),
        "overrides": [] if layout is None else layout.argv(),
        "layout": "the config as written" if layout is None else layout.command(),
        "mesh": report["mesh"], "fits": report["fits"],
        "reserved_gib": report["memory_bytes"]["reserved"] / GIB,
        "device_gib": report["memory_bytes"]["device_total"] / GIB,
        "tokens_per_second_per_gpu": report["tokens_per_second_per_gpu"], "mfu": report["mfu"],
        "step_seconds": t["step"],
        "exposed_comm_seconds": (t["data_parallel_comm_exposed"] + t["tensor_parallel_and_other_comm_exposed"]
                                 + t["pipeline_send_recv"]),
        "bubble_seconds": t["pipeline_bubble"],
        "time_seconds": t, "activation_checkpoint": report["activation_checkpoint"],
        "local_batch_size": report["local_batch_size"], "pipeline": report["pipeline"],
        "fsdp_gather": report["fsdp_gather"],
    }


class SearchProgressLine:
    """The search's one progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.start, self.tty = total, time.perf_counter(), sys.stderr.isatty()

    def show(self, priced: int, best: float, final: bool = False) -> None:
        line = (f"search: {priced} priced, {self.total} candidates left after pruning, best {best:,.0f} tokens/s/GPU, "
                f"{time.perf_counter() - self.start:.0f} s")
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif final or priced % 20 == 0:
            print(line, file=sys.stderr, flush=True)


def run_search(config: JobConfig) -> dict[str, Any]:
    """Search ``config``'s layouts on ``[dry_run] world_size`` devices; print the table, write search.json."""
    start = time.perf_counter()
    dry = config.dry_run
    world = dry.world_size
    device_type = "cpu" if dry.device == "cpu" else "cuda"
    if (dry.search_top < 1 or dry.search_workers < 1 or dry.gpus_per_node < 1 or dry.search_seconds < 0
            or dry.search_layouts < 0):
        raise ConfigError("[dry_run] search_top, search_workers and gpus_per_node must be positive, search_layouts "
                          "positive or 0 (auto), search_seconds positive or 0 (no time limit).")
    spec = dataclasses.replace(planned_device(dry), gpus_per_node=dry.gpus_per_node)
    base = dataclasses.replace(config, dry_run=dataclasses.replace(dry, search=False))
    pins = parse_pins(base)
    args = model_of(base)
    sizes = ModelSizes.of(args)
    check_world_can_hold(base, sizes, args, spec)
    float8 = dry.search_float8 and spec.float8_peak_flops is not None
    layouts = enumerate_layouts(base, args, world, dry.gpus_per_node, float8, dry.search_batch)
    fates: dict[Layout, str] = {}
    floors: dict[Layout, float] = {}  # the smallest memory seen, for "nothing fits"
    candidates = _prune(layouts, pins, args, sizes, spec, fates, floors)

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["titan_simple.dry_run.pricing_workers"])
    setup = dict(initializer=pricing_workers.start_worker, initargs=(base, world, device_type, spec))
    # Every layout runs in a fresh process (forked from the preloaded server), as a standalone dry run does: in a
    # reused one, DTensor's caches warmed by earlier work changed one 8B layout's async-TP pricing by 2% (7,181 vs
    # 7,304 tokens/s/GPU). The block classes share processes, but in a fixed order: when a pool handed them out as
    # workers came free, a class's ceiling, and with it the order of pricing, depended on the machine's load.
    with context.Pool(dry.search_workers, maxtasksperchild=1, **setup) as fresh:
        published_async = fresh.apply_async(pricing_workers.price, ((),))
        classes = sorted({_class_overrides(layout, world) for layout in candidates})
        phases = {"enumerate": time.perf_counter() - start}
        # Each worker measures a fixed share of the classes in a fixed order, in one fresh process: what a class
        # measures never depends on which worker got it, or when.
        shares = [classes[i::dry.search_workers] for i in range(dry.search_workers)]
        measured = fresh.map(pricing_workers.per_block_share, shares, chunksize=1)
        per_block = {c: m for share, ms in zip(shares, measured, strict=True) for c, m in zip(share, ms, strict=True)}
        phases["classes"] = time.perf_counter() - start - phases["enumerate"]
        phases["class_count"] = len(classes)
        bounded = _bound(candidates, per_block, base, args, sizes, spec, float8, fates, floors)
        published = published_async.get()
        deadline = start + dry.search_seconds if dry.search_seconds > 0 else None
        headroom = memory_headroom(dry.memory_headroom)
        rows, _ = _best_first(fresh, bounded, fates, floors, dry.search_top, dry.search_workers,
                              SearchProgressLine(len(bounded)), layout_budget(dry.search_layouts, world), deadline,
                              headroom, spec)
    published_row = {"error": published["error"]} if "error" in published else _row(None, published, headroom,
                                                                                       spec)
    phases["pricing"] = time.perf_counter() - start - phases["enumerate"] - phases["classes"]
    return _finish(config, base, rows, published_row, fates, layouts, time.perf_counter() - start, spec, phases,
                   floors)


def _prune(layouts: list[Layout], pins: Any, args: Any, sizes: ModelSizes, spec: DeviceSpec,
           fates: dict[Layout, str], floors: dict[Layout, float]) -> list[Layout]:
    """The layouts left after the pins, the dominance rules and the static memory floor (the others' fates
    recorded)."""
    candidates = []
    for layout in layouts:
        if not matches(layout, pins):
            fates[layout] = "filtered by search_fix"
        elif reason := dominated(layout):
            fates[layout] = reason
        elif (floor := memory_floor(layout, args, sizes, spec)) > spec.memory_bytes:
            fates[layout] = f"does not fit: parameters, gradients and AdamW state alone {floor / GIB:.1f} GiB"
            floors[layout] = floor
        else:
            candidates.append(layout)
    return candidates


def _bound(candidates: list[Layout], per_block: dict[Any, dict[str, Any]], base: JobConfig, args: Any,
           sizes: ModelSizes, spec: DeviceSpec, float8: bool, fates: dict[Layout, str],
           floors: dict[Layout, float]) -> list[tuple[float, Layout]]:
    """Each candidate's speed ceiling from its block class, fastest first (the lighter AC first among equals);
    those the trainer refuses or whose floor with activations does not fit get their fates instead."""
    world = base.dry_run.world_size
    bounded = []
    # bytes per element of the weights gathered and the gradients reduced, at least (float8 gathers 1)
    compute_bytes = 4 if base.training.mixed_precision_param == "float32" else 2
    gather_bytes = 1 if base.model.converters or float8 else compute_bytes
    reduce_bytes = 2 if base.training.mixed_precision_reduce == "bfloat16" else 4
    for layout in candidates:
        block = per_block[_class_overrides(layout, world)]
        if "error" in block:
            fates[layout] = f"refused by the trainer: {block['error']}"
            continue
        floors[layout] = floor = memory_floor(layout, args, sizes, spec, gather_bytes + reduce_bytes, block["kept"])
        if floor > spec.memory_bytes:
            fates[layout] = (f"does not fit: its AdamW state, held weights and one microbatch's activations "
                             f"alone {floor / GIB:.1f} GiB")
            continue
        tokens = base.training.seq_len * int(layout.values["training.global_batch_size"])
        dp_floor = data_parallel_floor(layout, args, sizes, spec, gather_bytes, reduce_bytes)
        tp = layout.degree("tensor_parallel")
        micro = int(layout.values.get("parallelism.pipeline_parallel_microbatch_size", 1))
        boundary = micro * base.training.seq_len // (tp * layout.degree("context_parallel")) * args.dim * compute_bytes
        bounded.append((speed_ceiling(layout, args, block["seconds"], block["ends_seconds"], tokens,
                                      world, spec, dp_floor, boundary), layout))
    bounded.sort(key=lambda item: (-item[0], AC_ORDER[item[1].values["activation_checkpoint.mode"]]))
    return bounded


def check_world_can_hold(base: JobConfig, sizes: ModelSizes, args, spec) -> None:
    """One line, before anything is priced, for a world too small to hold the model's weights, gradients and AdamW
    state at all (however it is sharded), with the GPUs to plan for instead."""
    world = base.dry_run.world_size
    state = (sizes.embedding + args.n_layers * sizes.block + sizes.head) * ADAM_BYTES_PER_PARAMETER
    usable = spec.memory_bytes - spec.runtime_bytes
    least = -(-int(state * (1 + spec.allocator_overhead)) // int(usable))
    if world >= least:
        return
    nodes = base.dry_run.gpus_per_node
    plan_for = -(-least // nodes) * nodes if least > nodes else least
    raise ConfigError(
        f"[dry_run] search: llama3 {base.model.flavor} cannot fit {world} x {spec.name}: its weights, gradients and "
        f"AdamW state alone are {state / GIB:,.0f} GiB, {least} GPUs' worth before any activation; plan for at least "
        f"{plan_for} GPUs (--dry_run.world_size {plan_for}).")


def _why_stop(ceiling: float, bar: float, top: int, asked: int, budget: int, deadline: float | None):
    """None to price the layout of ``ceiling`` (and go on), else what to say of it and every layout after it."""
    if deadline is not None and time.perf_counter() > deadline:
        return lambda c: f"not priced: the search_seconds limit ran out (ceiling {c:,.0f} tokens/s/GPU)"
    if asked >= budget:
        return lambda c: f"not priced: beyond the search_layouts count (ceiling {c:,.0f} tokens/s/GPU)"
    if ceiling < bar:  # sorted: every ceiling left is lower
        return lambda c: f"cannot win: ceiling {c:,.0f} < the {top}th row's {bar:,.0f} tokens/s/GPU"
    return None


def _trace_row(row: dict[str, Any]) -> None:
    """Debugging the bounds: every priced row as it comes, into ``$TITAN_SIMPLE_SEARCH_TRACE``."""
    if os.environ.get("TITAN_SIMPLE_SEARCH_TRACE"):
        with open(os.environ["TITAN_SIMPLE_SEARCH_TRACE"], "a") as f:
            f.write(json.dumps({k: row[k] for k in ("layout", "ceiling", "floor_gib", "device_gib", "fits",
                                                    "tokens_per_second_per_gpu", "time_seconds")}) + "\n")


def _best_first(pool, bounded, fates, floors, top: int, workers: int, progress: SearchProgressLine, budget: int,
                deadline: float | None, headroom: float, spec):
    """Price layouts in order of their speed ceiling (``workers + 1`` in flight) until ``top`` recommended rows beat
    every ceiling left, ``budget`` layouts are priced, or the ``deadline`` (``time.perf_counter``; None: none)
    passes. Results are taken in the order they were asked for, so every decision, and the table, is the same
    whatever the machine's load."""
    rows: list[dict[str, Any]] = []
    fitted: set[tuple] = set()  # layouts (without AC) whose lighter checkpointing is recommended
    pending: list[tuple[Any, float, Layout]] = []  # in the order they were asked for
    asked = index = 0

    def bar() -> float:
        fitting = sorted((r["tokens_per_second_per_gpu"] for r in rows if r["recommended"]), reverse=True)
        return fitting[top - 1] if len(fitting) >= top else 0.0

    def leave(rest, why) -> None:
        for ceiling, layout in rest:
            fates[layout] = why(ceiling)

    while True:
        while len(pending) <= workers and index < len(bounded):
            ceiling, layout = bounded[index]
            stop = _why_stop(ceiling, bar(), top, asked, budget, deadline)
            if stop is not None:
                leave(bounded[index:], stop)
                index = len(bounded)
                break
            index += 1
            if _sibling_key(layout) in fitted:
                fates[layout] = "skipped: a lighter activation checkpointing of this layout fits (only more recompute)"
                continue
            asked += 1
            pending.append((pool.apply_async(pricing_workers.price, (layout.overrides,)), ceiling, layout))
        if not pending:
            break
        done, ceiling, layout = pending.pop(0)
        report = done.get()
        if "error" in report:
            fates[layout] = f"refused by the trainer: {report['error']}"
            continue
        row = _row(layout, report, headroom, spec)
        row["ceiling"], row["floor_gib"] = ceiling, floors[layout] / GIB
        rows.append(row)
        fates[layout] = "priced"
        if row["recommended"]:
            fitted.add(_sibling_key(layout))
        progress.show(len(rows), max((r["tokens_per_second_per_gpu"] for r in rows if r["fits"]), default=0.0))
        _trace_row(row)
    progress.show(len(rows), max((r["tokens_per_second_per_gpu"] for r in rows if r["fits"]), default=0.0), True)
    return rows, fitted


def _no_fit(base, rows, floors, spec) -> ConfigError:
    """The one line for a world that no layout fits: the smallest memory found, and what would make it fit."""
    world = base.dry_run.world_size
    seen = [(r["device_gib"] * GIB, r["layout"], "predicted") for r in rows]
    seen += [(floor, layout.command(), "at least") for layout, floor in floors.items()]
    if not seen:
        return ConfigError(f"[dry_run] search: no layout of llama3 {base.model.flavor} is valid on {world} GPUs "
                           "(see search_fix and the degrees); try another --dry_run.world_size.")
    need, layout, how = min(seen, key=lambda item: item[0])
    nodes = base.dry_run.gpus_per_node
    more = -(-int(world * need / spec.memory_bytes) // nodes) * nodes  # memory per GPU falls about as 1/world
    return ConfigError(
        f"[dry_run] search: no layout of llama3 {base.model.flavor} fits {world} x {spec.name} "
        f"({spec.memory_bytes / GIB:.1f} GiB each); the smallest needs {how} {need / GIB:.1f} GiB ({layout}); plan "
        f"for about {max(more, world + nodes)} GPUs (--dry_run.world_size), a smaller global batch "
        "(--training.global_batch_size) or shorter sequences (--training.seq_len).")


def _finish(config, base, rows, published_row, fates, layouts, seconds, spec, phases, floors) -> dict[str, Any]:
    dry = config.dry_run
    headroom = memory_headroom(dry.memory_headroom)
    fitting = sorted((r for r in rows if r["recommended"]), key=lambda r: -r["tokens_per_second_per_gpu"])
    tight = sorted((r for r in rows if r["fits"] and not r["recommended"]),
                   key=lambda r: -r["tokens_per_second_per_gpu"])
    unpriced = [f for f in fates.values() if f.startswith("not priced")]
    if not fitting and unpriced:
        raise ConfigError(f"[dry_run] search: llama3 {base.model.flavor} on {dry.world_size} x {spec.name}: "
                          f"{len(rows)} layouts priced, none recommended ({len(tight)} fit with less than "
                          f"{headroom:.0%} memory headroom); price more with --dry_run.search_layouts or pin knobs "
                          "with --dry_run.search_fix.")
    if not fitting and tight:
        best = tight[0]
        raise ConfigError(
            f"[dry_run] search: no layout of llama3 {base.model.flavor} fits {dry.world_size} x {spec.name} with the "
            f"{headroom:.0%} memory headroom the dry run's own error asks for; the fastest that fits at all "
            f"({best['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, {best['headroom']:.0%} free: "
            f"{' '.join(best['overrides'])}) may not fit a real {spec.name}. Plan for more GPUs or set "
            "--dry_run.memory_headroom lower at your own risk.")
    if not fitting:
        raise _no_fit(base, rows, floors, spec)
    for row in fitting[1:dry.search_top]:
        row["why_not_first"] = why_loses(row, fitting[0])
    if "error" not in published_row:
        faster = [r for r in fitting if r["tokens_per_second_per_gpu"] > published_row["tokens_per_second_per_gpu"]]
        published_row["rank"] = 1 + len(faster)
        if faster:
            published_row["why_not_first"] = why_loses(published_row, fitting[0])
    counts = Counter(fates.get(layout, "not reached").split(":")[0] for layout in layouts)
    ceilings = [float(f.split("ceiling ")[1].split(" ")[0].replace(",", "")) for f in unpriced]
    result = {
        "model": base.model.flavor, "world_size": dry.world_size, "device": spec.name,
        "gpus_per_node": dry.gpus_per_node, "seconds": seconds, "phase_seconds": phases,
        "layouts": len(layouts), "fates": dict(counts), "table": fitting[:dry.search_top],
        "published": published_row, "priced": rows, "memory_headroom": headroom,
        "config_global_batch": str(global_rows(base, dry.world_size)),
        "tight": {"count": len(tight), "fastest": tight[0]["tokens_per_second_per_gpu"] if tight else None},
        "unpriced": {"count": len(unpriced), "highest_ceiling": max(ceilings, default=None),
                     "budget": layout_budget(dry.search_layouts, dry.world_size),
                     "time_limited": any("search_seconds" in f for f in unpriced)},
        "candidates": [{"layout": layout.command(), "fate": fates.get(layout, "not reached")} for layout in layouts],
    }
    print(format_search(result), flush=True)
    write_json(base.job.dump_folder, "search.json", result)
    return result


__all__ = ["run_search", "checked_plan"]
