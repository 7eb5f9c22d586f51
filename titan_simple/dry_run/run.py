"""Plan a cluster run on this machine: build one rank of the real world size and predict memory and speed.

    python train.py --config llama3_70b.toml --dry_run --dry_run.world_size 256 --dry_run.device h100

This process becomes rank ``[dry_run] rank`` of ``world_size`` on a fake process group (``fake_pg``): the
degrees are checked exactly as for training and the device mesh is built. Then, in three modules:

* ``rank_step.trace_rank``: this rank's model parts by the real recipe on the meta device, and one traced
  training step (every op, saved activation and collective, with this rank's shapes; nothing allocated);
* ``prediction.measure_trace`` / ``finish_report``: the memory / time model over that trace (roofline, collectives,
  pipeline bubble, MFU), taken on 2 and 3 blocks per stage and carried to the full depth
  (``extrapolation.plan_report``);
* ``printout.format_report``: the table printed here; the report itself is written as ``dry_run.json``.

How it works and how well it predicts published runs: ``docs/dry_run.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from titan_simple.config import JobConfig
from titan_simple.core.plan import resolve_plan
from titan_simple.dry_run.extrapolation import plan_report
from titan_simple.dry_run.hardware import DeviceSpec, planned_device
from titan_simple.dry_run.printout import format_report, write_json
from titan_simple.errors import ConfigError
from titan_simple.parallel.dims import ParallelDims
from titan_simple.parallel.fake_process_group import init_fake_process_group

logger = logging.getLogger("titan_simple")

_RAN = False


def run_dry_run(config: JobConfig, write: bool = True, spec: DeviceSpec | None = None) -> dict[str, Any]:
    """Plan ``config`` on ``[dry_run] world_size`` devices of kind ``[dry_run] device`` (or ``spec``): print the
    table, write ``dry_run.json`` to the dump folder, return the report."""
    global _RAN
    if config.dry_run.search:  # many layouts, each priced in a worker process (search.py)
        from titan_simple.dry_run.search import run_search  # noqa: PLC0415

        return run_search(config)
    if _RAN:
        # DTensor caches sharding decisions keyed by meshes compared by value: a second fake world in the same
        # process gets DTensors on the first world's (destroyed) meshes. Run each plan in its own process.
        raise RuntimeError("run_dry_run: one dry run per process (DTensor caches the first run's meshes); "
                           "start a new process, e.g. python train.py --dry_run ...")
    _RAN = True
    dry_run = config.dry_run
    try:
        ParallelDims.from_config(config, dry_run.world_size)
    except ConfigError as error:
        raise ConfigError(f"[dry_run] world_size = {dry_run.world_size} does not match the degrees: {error}") from None
    if config.fault_tolerance.enable:  # world_size is one group's; the cross-group all-reduce is not priced
        logger.warning("dry run: [fault_tolerance] plans one replica group of world_size %d (the cross-group "
                       "gradient all-reduce, outside the step, is not in the prediction)", dry_run.world_size)
        config = dataclasses.replace(config, fault_tolerance=dataclasses.replace(config.fault_tolerance, enable=False))
    # The trainer's plan and checks, for the device planned for (it decides the "auto" dtypes).
    run = resolve_plan(config, dry_run.world_size, "cpu" if dry_run.device == "cpu" else "cuda")
    if not 0 <= dry_run.rank < dry_run.world_size:
        raise ConfigError(f"[dry_run] rank = {dry_run.rank} is not a rank of world_size = {dry_run.world_size}; "
                          f"use 0 .. {dry_run.world_size - 1}.")
    if spec is None:
        spec = planned_device(dry_run)

    if run.float8 is not None and spec.float8_peak_flops is None:
        raise ConfigError(f"[model] converters = ['float8'] needs float8 matmuls, which {spec.name} does not have: "
                          "plan for h100 or h200 ([dry_run] device), or drop float8 from [model] converters.")
    init_fake_process_group(dry_run.rank, dry_run.world_size)
    try:
        mesh = run.dims.build_mesh("cpu")
        pp_rank = mesh["pp"].get_local_rank() if run.pipeline is not None else 0
        report = plan_report(run, mesh, pp_rank, dry_run.rank, spec)
    finally:
        dist.destroy_process_group()
    if run.stages is not None:  # every stage's step, each in a process of its own
        from titan_simple.dry_run.stage_plans import price_stages  # noqa: PLC0415

        report["stages"] = price_stages(config, run, report, spec)
    text = format_report(report)
    print(text, flush=True)
    if write:
        write_json(config.job.dump_folder, "dry_run.json", report)
    return report
