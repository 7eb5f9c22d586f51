"""Trace a few transformer blocks, predict the full depth: the dry run's shortcut.

Every transformer block of a Llama model runs the same ops on the same shapes, saves the same activations and
issues the same collectives, so everything the report reads off a trace (``report.Measured``: bytes, op and
collective seconds, counts, peaks) grows by the same amount with each block a rank holds. The dry run traces
the rank with 2 and with 3 blocks per local model part (per pipeline stage) and extends the line to the full
depth: ``full = m2 + (m3 - m2) x (blocks - 2)``. (Not 1 and 2: with one block per part the peak can sit
elsewhere; 405B's pipeline rank peaks in backward at 1 block, in the once-per-step reduce from 2 on.)
The result matches a full trace to float rounding (``tests/test_dry_run_search.py`` compares them on a
tensor- and pipeline-parallel layout) in a fraction of its time, which is what lets the layout search
(``search.py``) price thousands of layouts. Layouts whose blocks are not alike fall back to the full trace
(``extrapolation_blocks`` says which). ``plan_report`` is the one report of a layout that the standalone dry run
(``dry_run/run.py``) and the search's workers (``pricing_workers.py``) both print.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from titan_simple.core.plan import RunPlan, resolve_plan
from titan_simple.dry_run.hardware import DeviceSpec
from titan_simple.dry_run.mesh_dims import group_names
from titan_simple.dry_run.prediction import Measured, finish_report, measure_trace
from titan_simple.dry_run.rank_step import trace_rank

TRACED_BLOCKS = (2, 3)  # blocks per part of the two short traces
MIN_BLOCKS = 5  # below this many blocks per part, the full trace is about as cheap: take it


def extrapolation_blocks(run: RunPlan, pp_rank: int) -> float | None:
    """Blocks per local part of ``pp_rank`` at full depth, or None where the trace must be taken whole: regional
    compilation (its regions group blocks), block-level selective AC (every N-th block differs), manual buckets
    or a hand-made pipeline split, parts of unequal depth on this rank, or a model this shallow."""
    config = run.config
    if config.dry_run.full_trace or run.compile.mode == "regional" or run.compile.manual_plan:
        return None
    if run.parallel.ac_mode == "selective" and run.parallel.ac_option not in ("op", "op_all_matmuls"):
        return None
    parallelism = config.parallelism
    if parallelism.pipeline_parallel_split_points or parallelism.pipeline_parallel_layers_per_stage is not None:
        return None
    plan = run.pipeline
    if plan is None:
        blocks = [run.model_args.n_layers]
    else:
        blocks = [len(plan.stage_layers[s]) for s in plan.stages_of_rank(pp_rank)]
    if len(set(blocks)) != 1 or blocks[0] < MIN_BLOCKS:
        return None
    return float(blocks[0])


def reduced_layers(run: RunPlan, blocks_per_part: int) -> int:
    """``n_layers`` that gives every pipeline stage (or the whole model) ``blocks_per_part`` blocks."""
    return blocks_per_part * (run.pipeline.num_stages if run.pipeline is not None else 1)


def _zero_like(value: Any) -> Any:
    return {key: _zero_like(v) for key, v in value.items()} if isinstance(value, dict) else 0


def _line(a: Any, b: Any, k: float) -> Any:
    """``a + (b - a) k`` through numbers and dicts of numbers (a key missing on one side counts 0); text: ``b``."""
    if isinstance(b, str):
        return b
    if isinstance(b, dict):
        keys = list(dict.fromkeys([*a, *b]))
        return {key: _line(a.get(key, _zero_like(b.get(key))), b.get(key, _zero_like(a.get(key))), k) for key in keys}
    if isinstance(a, int) and isinstance(b, int) and float(k).is_integer():
        return a + (b - a) * int(k)  # exact in integers
    return a + (b - a) * k


def extrapolate(m1: Measured, m2: Measured, blocks: float) -> Measured:
    """``m1`` / ``m2`` measured at ``TRACED_BLOCKS`` blocks per part, carried to ``blocks`` blocks per part."""
    k = (blocks - TRACED_BLOCKS[0]) / (TRACED_BLOCKS[1] - TRACED_BLOCKS[0])
    values = {f.name: _line(getattr(m1, f.name), getattr(m2, f.name), k) for f in dataclasses.fields(Measured)}
    values["trace_seconds"] = m1.trace_seconds + m2.trace_seconds
    return Measured(**values)


def measure_short(run: RunPlan, mesh: DeviceMesh | None, spec: DeviceSpec, blocks_per_part: int) -> Measured:
    """``run`` with ``blocks_per_part`` transformer blocks per local part, traced and measured on ``mesh``."""
    model = dataclasses.replace(run.config.model, n_layers=reduced_layers(run, blocks_per_part))
    short = resolve_plan(dataclasses.replace(run.config, model=model), run.dims.world_size, run.device_type)
    return measure_trace(short, trace_rank(short, mesh), spec, group_names(mesh, run.dims))


def plan_report(run: RunPlan, mesh: DeviceMesh | None, pp_rank: int, rank: int, spec: DeviceSpec) -> dict[str, Any]:
    """The report of ``run``'s ``rank`` on ``mesh`` (inside the fake process group): traces of 2 and 3 blocks per
    local part carried to the full depth (``extrapolation.py``), or the full trace where blocks are not alike."""
    names = group_names(mesh, run.dims)
    blocks = extrapolation_blocks(run, pp_rank)
    if blocks is None:
        return finish_report(run, pp_rank, rank, measure_trace(run, trace_rank(run, mesh), spec, names), spec)
    measured = [measure_short(run, mesh, spec, per_part) for per_part in TRACED_BLOCKS]
    report = finish_report(run, pp_rank, rank, extrapolate(*measured, blocks), spec)
    report["traced_blocks_per_part"] = list(TRACED_BLOCKS)
    return report
