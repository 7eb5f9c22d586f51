"""The layouts a cluster can run a model with: every combination of the trainer's own knobs that is valid for
the model and the world size, each as the ``--section.key value`` overrides that select it.

``enumerate_layouts`` lists them (``search.py`` ranks them). The global batch in rows is held fixed (or varied
within a factor of 2 with ``[dry_run] search_batch``), so every layout trains on the same tokens per step.
Validity is the trainer's own: ``checked_plan`` runs ``resolve_plan`` on the layout's config, the same checks a
launch would run, so the search never proposes a layout the trainer would refuse.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from titan_simple.config import JobConfig, validate
from titan_simple.config.loading import _set
from titan_simple.core.plan import RunPlan, resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import ModelArgs

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
AC_MODES = ("none", "selective", "full")
# Knobs that change only the time model, not the traced step (``prediction.build_report`` reads them from the plan):
# layouts differing in these alone share one trace.
REPORT_ONLY = ("training.global_batch_size", "parallelism.enable_async_tensor_parallel")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """One point of the search space, as the overrides that select it (``section.key`` -> value text)."""

    overrides: tuple[tuple[str, str], ...]

    @property
    def values(self) -> dict[str, str]:
        return dict(self.overrides)

    def argv(self) -> list[str]:
        """The overrides to paste after ``train.py --config ...``."""
        return [arg for key, value in self.overrides for arg in (f"--{key}", value)]

    def command(self) -> str:
        return " ".join(f"--{key} {value}" for key, value in self.overrides)

    def degree(self, name: str) -> int:
        """A parallel degree; context parallel is 1 where the search did not vary it."""
        default = "1" if name == "context_parallel" else None
        return int(self.values.get(f"parallelism.{name}_degree", default))

    def trace_key(self) -> tuple[tuple[str, str], ...]:
        """What the traced step depends on: all but the report-only knobs; under pipeline parallel the traced
        microbatch is ``pipeline_parallel_microbatch_size``, so the local batch is report-only too."""
        skip = set(REPORT_ONLY)
        if self.degree("pipeline_parallel") > 1:
            skip.add("training.local_batch_size")
        return tuple((k, v) for k, v in self.overrides if k not in skip)

    def mesh_key(self) -> tuple[int, ...]:
        return tuple(self.degree(n) for n in ("data_parallel_replicate", "data_parallel_shard", "context_parallel",
                                              "tensor_parallel", "pipeline_parallel"))


def apply_overrides(base: JobConfig, overrides: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> JobConfig:
    """``base`` with ``overrides`` set as command-line options would be (``load_job_config``'s own path)."""
    config = copy.deepcopy(base)
    for key, value in overrides:
        section, _, name = key.partition(".")
        _set(config, section, name, value, "command line", from_cli=True)
    validate(config)
    return config


def model_of(config: JobConfig) -> ModelArgs:
    """The model the config builds, as the trainer resolves it (planned on one process: any world will do)."""
    single = [(f"parallelism.{name}", "1") for name in ("data_parallel_replicate_degree",
              "data_parallel_shard_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
              "context_parallel_degree")]
    single.append(("parallelism.enable_async_tensor_parallel", "false"))
    return resolve_plan(apply_overrides(config, single), 1, "cuda").model_args


def checked_plan(config: JobConfig, world_size: int, device_type: str) -> RunPlan | str:
    """The trainer's plan of ``config``, or the one-line reason it refuses the layout."""
    try:
        return resolve_plan(config, world_size, device_type)
    except ConfigError as error:
        return str(error)


def global_rows(config: JobConfig, world_size: int) -> int:
    """Rows (sequences) per optimizer step of the config as written, at ``world_size``; with fixed degrees, the rows
    it steps with on its own world (the search keeps the batch, not the layout)."""
    parallelism, training = config.parallelism, config.training
    if training.global_batch_size > 0:
        return training.global_batch_size
    shard = parallelism.data_parallel_shard_degree
    if shard > 0:
        return training.local_batch_size * parallelism.data_parallel_replicate_degree * shard
    others = parallelism.data_parallel_replicate_degree * parallelism.tensor_parallel_degree
    others *= parallelism.pipeline_parallel_degree * parallelism.context_parallel_degree
    dp = parallelism.data_parallel_replicate_degree * (shard if shard > 0 else world_size // others)
    if dp < 1 or dp * others != world_size:
        raise ConfigError(
            f"[dry_run] search: the config's own degrees do not fit world_size = {world_size}, so they do not say "
            "its global batch; give it: --training.global_batch_size ROWS (sequences per optimizer step).")
    return training.local_batch_size * dp


def hsdp_replicas(dp: int, tp: int, gpus_per_node: int) -> list[int]:
    """Replica counts of the data-parallel ranks: 1 (FSDP), ``dp`` (DDP) and the HSDP whose shard group fills a
    node (``gpus_per_node / tp`` shards: the reason for HSDP is that its reduce-scatters stay on NVLink)."""
    shard = gpus_per_node // tp
    return sorted({1, dp} | ({dp // shard} if shard > 1 and dp % shard == 0 else set()))


def dominated(layout: Layout) -> str | None:
    """Why the dry run's model can never rank ``layout`` above a sibling layout, or None. Regional compilation
    prices the same step with more exposed traffic and the hand-off's held weights (it only shortens the
    compile); GPipe and LoopedBFS have the bubbles of 1F1B and Interleaved1F1B with more microbatches in flight,
    wherever those are valid."""
    values = layout.values
    if values.get("compile.regional") == "true":
        return "dominated by whole-model compile (the same step, more exposed traffic; regional only compiles faster)"
    schedule = values.get("parallelism.pipeline_parallel_schedule")
    if schedule in ("GPipe", "LoopedBFS"):
        pp = layout.degree("pipeline_parallel")
        n = int(values["training.local_batch_size"]) // int(values["parallelism.pipeline_parallel_microbatch_size"])
        if schedule == "GPipe" and n >= pp:
            return "dominated by 1F1B (the same bubble, fewer microbatches in flight)"
        if schedule == "LoopedBFS" and n % max(1, n // pp) == 0:
            return "dominated by Interleaved1F1B (the same bubble, fewer microbatches in flight)"
    return None


def _batch_rows(rows: int, vary: bool) -> list[int]:
    return sorted({rows // 2, rows, rows * 2} - {0}) if vary else [rows]


def _pipeline_options(lbs: int, pp: int, n_layers: int) -> list[tuple[str, str, int]]:
    """(schedule, microbatch size, microbatches) under pipeline parallel; ``plan_pipeline`` checks the rest."""
    if pp == 1:
        return [("", "", 1)]
    out = []
    for schedule in SCHEDULES:
        stages = pp * (1 if schedule in ("GPipe", "1F1B") else 2)
        if stages > n_layers:
            continue
        for micro in divisors(lbs):
            out.append((schedule, str(micro), lbs // micro))
    return out


# Context parallel is searched from this sequence length up: below it (Llama 3's pretraining length is 8K) the plain
# FSDP / TP layouts are the ones published, and the search budget goes to them.
CONTEXT_PARALLEL_FROM_SEQ_LEN = 16384


def _context_parallel_degrees(config: JobConfig, world: int, tp: int) -> list[int]:
    """The context-parallel degrees to try with ``world`` ranks left beside tensor parallel: each that splits the
    sequence into 2 x cp x tp equal chunks, for long sequences; otherwise the config's own."""
    seq_len, own = config.training.seq_len, config.parallelism.context_parallel_degree
    if seq_len < CONTEXT_PARALLEL_FROM_SEQ_LEN:
        return [own] if world % own == 0 else []
    return [cp for cp in divisors(world) if seq_len % (2 * cp * tp) == 0]


def enumerate_layouts(config: JobConfig, model: ModelArgs, world_size: int, gpus_per_node: int, float8: bool,
                      vary_batch: bool = False, max_pp_microbatch: int = 2) -> list[Layout]:
    """Every layout of the trainer's knobs for ``model`` on ``world_size`` devices (not yet checked by the
    trainer): tensor parallel within a node and dividing the kv heads, pipeline stages that split the layers,
    context parallel for long sequences (``_context_parallel_degrees``), data parallel as FSDP, HSDP or DDP, the
    local batch and accumulation, the pipeline schedule and microbatch size (up to ``max_pp_microbatch``
    sequences), when SimpleFSDP gathers, activation checkpointing, whole or regional compile and (``float8``)
    float8 linears."""
    layouts = []
    rows_options = _batch_rows(global_rows(config, world_size), vary_batch)
    kv_heads = model.n_kv_heads or model.n_heads
    searched_cp = (config.training.seq_len >= CONTEXT_PARALLEL_FROM_SEQ_LEN
                   or config.parallelism.context_parallel_degree > 1)
    meshes = [(tp, pp, cp) for tp in divisors(world_size) if tp <= gpus_per_node and not kv_heads % tp
              and not model.n_heads % tp for pp in divisors(world_size // tp) if pp <= model.n_layers
              for cp in _context_parallel_degrees(config, world_size // (tp * pp), tp)]
    for tp, pp, cp in meshes:
        dp = world_size // (tp * pp * cp)
        for replicate, rows in itertools.product(hsdp_replicas(dp, tp * cp, gpus_per_node), rows_options):
            if rows % dp:
                continue
            per_rank = rows // dp
            # Under pipeline parallel the local batch is the pipeline's batch (no accumulation on top).
            for lbs in divisors(per_rank) if pp == 1 else [per_rank]:
                for schedule, micro, n_micro in _pipeline_options(lbs, pp, model.n_layers):
                    if pp > 1 and int(micro) > max_pp_microbatch:
                        continue
                    several = per_rank // lbs > 1 or n_micro > 1
                    gathers = ("per_microbatch", "once_per_step") if several and dp * cp > 1 else ("per_microbatch",)
                    mesh = [("parallelism.data_parallel_replicate_degree", str(replicate)),
                            ("parallelism.data_parallel_shard_degree", str(dp // replicate))]
                    if searched_cp:  # on GPUs context parallel runs FlexAttention
                        mesh += [("parallelism.context_parallel_degree", str(cp))] + (
                            [("model.attention", "flex")] if cp > 1 else [])
                    mesh += [("parallelism.tensor_parallel_degree", str(tp)),
                             ("parallelism.pipeline_parallel_degree", str(pp))]
                    if pp > 1:
                        mesh += [("parallelism.pipeline_parallel_schedule", schedule),
                                 ("parallelism.pipeline_parallel_microbatch_size", micro)]
                    for gather, ac, regional, f8 in itertools.product(
                            gathers, AC_MODES, (False, True), (False, True) if float8 else (False,)):
                        knobs = _knobs(mesh, tp, gather, lbs, rows, ac, regional, f8 if float8 else None)
                        layouts.append(Layout(tuple(knobs)))
    return layouts


def _knobs(mesh: list[tuple[str, str]], tp: int, gather: str, lbs: int, rows: int, ac: str, regional: bool,
           float8: bool | None) -> list[tuple[str, str]]:
    """One layout's overrides: its mesh, then the step's knobs."""
    values = [*mesh, ("parallelism.enable_async_tensor_parallel", "true" if tp > 1 else "false"),
              ("parallelism.fsdp_gather", gather), ("training.local_batch_size", str(lbs)),
              ("training.global_batch_size", str(rows)), ("activation_checkpoint.mode", ac)]
    if ac == "selective":
        values.append(("activation_checkpoint.selective_ac_option", "op"))
    values += [("compile.enable", "true"), ("compile.regional", str(regional).lower())]
    if float8 is not None:
        values.append(("model.converters", "float8" if float8 else "[]"))
    return values


def matches(layout: Layout, pins: dict[str, str]) -> bool:
    """Whether ``layout`` sets every pinned ``section.key`` to its value (``[dry_run] search_fix``)."""
    values = layout.values
    return all(values.get(key, None) == value for key, value in pins.items())


__all__ = ["Layout", "apply_overrides", "checked_plan", "dominated", "enumerate_layouts", "global_rows",
           "hsdp_replicas", "matches", "model_of"]
