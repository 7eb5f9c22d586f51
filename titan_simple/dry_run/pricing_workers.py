"""The layout search's worker processes: each is one fake rank 0 of the planned world, pricing layouts.

A dry run builds a fake process group and a device mesh (``dry_run/run.py``). DTensor caches sharding decisions
keyed by meshes compared by value, so a process must not build a second world after destroying the first; a
worker therefore builds its one fake world when it starts, keeps one mesh per set of degrees, and never tears
them down. ``price`` runs exactly the standalone dry run's ``extrapolation.plan_report`` on a layout, in a process of
its own (``search.py``: a reused one's warm DTensor caches changed some prices), so a row of the search is the
report a ``train.py --dry_run`` of its overrides prints (``tests/test_dry_run_search.py`` checks it).
Workers start from a forkserver that has imported the planning stack once (about 5 s saved per worker).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from titan_simple.config import JobConfig
from titan_simple.dry_run.extrapolation import measure_short, plan_report
from titan_simple.dry_run.hardware import DeviceSpec
from titan_simple.dry_run.layouts import apply_overrides, checked_plan
from titan_simple.parallel.fake_process_group import init_fake_process_group

_WORLD: dict[str, Any] = {}


def start_worker(base: JobConfig, world_size: int, device_type: str, spec: DeviceSpec) -> None:
    """Pool initializer: this process becomes rank 0 of a fake world of ``world_size``. It never raises: a pool
    replaces a worker whose initializer fails, forever; the failure is every task's answer instead."""
    warnings.filterwarnings("ignore")  # torch's warnings of the meta build, once per layout: the table is the output
    _WORLD.update(base=base, world_size=world_size, device_type=device_type, spec=spec, meshes={})
    try:
        init_fake_process_group(0, world_size)
    except Exception as error:  # noqa: BLE001 -- reported by every task of this worker
        _WORLD["error"] = f"the search's worker could not start a fake world of {world_size}: {error}"


def _mesh(run):
    key = (run.dims.dp_replicate, run.dims.dp_shard, run.dims.cp, run.dims.tp, run.dims.pp)
    meshes = _WORLD["meshes"]
    if key not in meshes:
        meshes[key] = run.dims.build_mesh("cpu")
    return meshes[key]


def price(overrides: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The dry-run report of the base config with ``overrides`` (``{"error": ...}`` if the trainer refuses it)."""
    if "error" in _WORLD:
        return {"error": _WORLD["error"]}
    start = time.perf_counter()
    config = apply_overrides(_WORLD["base"], overrides)
    run = checked_plan(config, _WORLD["world_size"], _WORLD["device_type"])
    if isinstance(run, str):
        return {"error": run}
    mesh = _mesh(run)
    report = plan_report(run, mesh, 0, 0, _WORLD["spec"])
    report["search_seconds"] = time.perf_counter() - start
    return report


def per_block_share(classes: list[tuple[tuple[str, str], ...]]) -> list[dict[str, float] | dict[str, str]]:
    """``per_block`` of each class, in order, in this one process."""
    return [per_block(overrides) for overrides in classes]


def per_block(overrides: tuple[tuple[str, str], ...]) -> dict[str, float] | dict[str, str]:
    """What one transformer block costs under ``overrides`` (no pipeline): the seconds of its ops and of its
    exposed tensor-parallel collectives per microbatch, and those of the model's ends (embedding, head, loss), and
    the activation bytes it keeps for backward, from traces of 1 and 2 blocks. The search's bounds use them."""
    if "error" in _WORLD:
        return {"error": _WORLD["error"]}
    config = apply_overrides(_WORLD["base"], overrides)
    run = checked_plan(config, _WORLD["world_size"], _WORLD["device_type"])
    if isinstance(run, str):
        return {"error": run}
    mesh = _mesh(run)
    # compute and kept bytes are linear from one block on (the peak is not: extrapolation.py)
    a, b = (measure_short(run, mesh, _WORLD["spec"], blocks) for blocks in (1, 2))
    # Tensor-parallel collectives sit on the critical path (or their async share does): in every layout's pass.
    block = b.compute_pass - a.compute_pass + b.exposed_pass - a.exposed_pass
    ends = a.compute_pass + a.exposed_pass - block  # embedding, norm, output and loss
    return {"seconds": block, "ends_seconds": ends, "kept": b.kept - a.kept}
