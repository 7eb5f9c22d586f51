"""The value checks of ``[[training.stages]]`` that need no hardware (``config/loading.validate`` calls them): each
one line naming the stage and the fix. What depends on the layout (a batch that does not divide over it, a seq_len
context parallel cannot cut) is ``core/stages.resolve_stages``'s."""

from __future__ import annotations

import math

from titan_simple.config.schema import JobConfig, TrainingStage
from titan_simple.errors import ConfigError


def stage_label(number: int, stage: TrainingStage) -> str:
    """How the logs and errors name a stage: its name, or "stage N" (stage 0 is [training] itself)."""
    return stage.name or f"stage {number}"


def check_stages(config: JobConfig) -> None:
    """Raise the one-line ConfigError of the first impossible ``[[training.stages]]`` entry."""
    training = config.training
    stages = training.stages
    if not stages:
        return
    where = f"{config.sources.get('training.stages', 'default value')}: [[training.stages]]"
    names = [stage.name for stage in stages if stage.name]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: two stages are named {sorted({n for n in names if names.count(n) > 1})[0]!r}; "
                          "give every stage its own name.")
    previous_step = 0
    for number, stage in enumerate(stages, start=1):
        label = f"{where} '{stage_label(number, stage)}'"
        if (stage.start_step > 0) == (stage.start_tokens > 0):
            raise ConfigError(f"{label}: set exactly one of start_step or start_tokens, a positive number (the "
                              "run's first settings are [training]'s own).")
        if stage.start_step > 0:
            if stage.start_step <= previous_step:
                raise ConfigError(f"{label}: start_step = {stage.start_step} is not after the previous stage's "
                                  f"({previous_step}); list the stages in the order they start.")
            previous_step = stage.start_step
        if stage.global_batch_size == 0 or stage.global_batch_size < -1:
            raise ConfigError(f"{label}: global_batch_size = {stage.global_batch_size} is impossible; use -1 (the "
                              "previous stage's) or a positive number of sequences.")
        if stage.seq_len == 0 or stage.seq_len < -1:
            raise ConfigError(f"{label}: seq_len = {stage.seq_len} is impossible; use -1 (the previous stage's) or "
                              "a positive number of tokens.")
        _check_weights(config, label, stage)
    decaying = [stage_label(n, s) for n, s in enumerate(stages, start=1) if s.lr_decay]
    if len(decaying) > 1:
        raise ConfigError(f"{where}: lr_decay is set on {' and '.join(decaying)}; the decay starts once, so set it on "
                          "one stage.")
    if decaying and config.lr_scheduler.decay_ratio is not None:
        raise ConfigError(f"{where} '{decaying[0]}': lr_decay starts the decay at the stage, and [lr_scheduler] "
                          f"decay_ratio = {config.lr_scheduler.decay_ratio} sets it too; remove decay_ratio from the "
                          "file (or --lr_scheduler.decay_ratio none).")
    if decaying and config.lr_scheduler.decay_type == "constant":
        raise ConfigError(f"{where} '{decaying[0]}': lr_decay needs a decay, and [lr_scheduler] decay_type is "
                          "'constant'; choose linear, sqrt or cosine.")


def _check_weights(config: JobConfig, label: str, stage: TrainingStage) -> None:
    if not stage.mixture_weights:
        return
    sources = [entry.name for entry in config.training.mixture]
    if not sources:
        raise ConfigError(f"{label}: mixture_weights needs [[training.mixture]] sources; this run reads one "
                          "dataset.")
    for name, weight in stage.mixture_weights.items():
        if name not in sources:
            raise ConfigError(f"{label}: mixture_weights names '{name}', which is not a [[training.mixture]] source "
                              f"({', '.join(sources)}).")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ConfigError(f"{label}: mixture_weights {name} = {weight!r} is impossible; use a share >= 0 (0 "
                              "leaves the source out).")
