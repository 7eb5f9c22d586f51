"""Optimizer and learning-rate schedule.

Weight decay applies to every parameter, norms and embeddings included (the TorchTitan convention): one
parameter group keeps the optimizer state layout simple to checkpoint and to shard. With ``AdamW`` the decay
is decoupled (``p -= lr * weight_decay * p``); with ``Adam`` it is classic L2 (``grad += weight_decay * p``).

Parameters may be DTensors (FSDP2 / tensor-parallel shards): every implementation works on them in torch
2.13 because Adam is elementwise, so each rank updates its own shard with the same arithmetic as on a plain
tensor (``tests/test_optim.py`` checks bitwise equality).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from titan_simple.core.muon import MuonWithAdamW, split_parameters
from titan_simple.errors import ConfigError

if TYPE_CHECKING:
    from titan_simple.config import JobConfig
    from titan_simple.core.stages import StagePlan

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
IMPLEMENTATIONS = ("foreach", "for-loop", "fused")
DECAY_TYPES = ("linear", "sqrt", "cosine", "constant")

logger = logging.getLogger(__name__)


def _implementation_kwargs(implementation: str) -> dict[str, bool]:
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for-loop":
        return {"foreach": False}
    if implementation == "fused":
        return {"fused": True}
    raise ConfigError(
        f"[optimizer] implementation = {implementation!r} is not supported; "
        f"use one of {', '.join(IMPLEMENTATIONS)}."
    )


def build_optimizer(
    model: nn.Module,
    *,
    name: str = "AdamW",
    lr: float,
    eps: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    implementation: str = "foreach",
) -> torch.optim.Optimizer:
    """One optimizer over every trainable parameter of ``model`` (one param group, decay on all of them)."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"[optimizer] name = {name!r} is not supported; use 'AdamW' or 'Adam'.")
    if not lr > 0:
        raise ConfigError(f"[optimizer] lr = {lr!r} is impossible; use a positive learning rate.")
    if not eps > 0:
        raise ConfigError(f"[optimizer] eps = {eps!r} is impossible; use a positive epsilon.")
    if not weight_decay >= 0:
        raise ConfigError(f"[optimizer] weight_decay = {weight_decay!r} is impossible; use a value >= 0.")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"[optimizer] betas = {betas!r} is impossible; use two values in [0, 1).")
    params = [p for p in model.parameters() if p.requires_grad]
    kernel_style = _implementation_kwargs(implementation)
    return OPTIMIZERS[name](params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel_style)


def optimizer_from_config(config: JobConfig, model: nn.Module, compiled: bool = False) -> torch.optim.Optimizer:
    """``build_optimizer`` with the ``[optimizer]`` section's settings; ``name = "Muon"``: ``build_muon``'s
    (``compiled``: the run compiles, Muon's Newton-Schulz too)."""
    optimizer_config = config.optimizer
    if optimizer_config.name == "Muon":
        return build_muon(model, config, compiled)
    return build_optimizer(model, name=optimizer_config.name, lr=optimizer_config.lr, eps=optimizer_config.eps,
                           weight_decay=optimizer_config.weight_decay, implementation=optimizer_config.implementation)


def build_muon(model: nn.Module, config: JobConfig, compiled: bool = False) -> MuonWithAdamW:
    """Muon for the block matrices of ``model`` (``core/muon.py``), AdamW for the rest, with ``[optimizer]``'s keys.
    Every rank calls it at once (its matrices' owners are agreed collectively)."""
    settings = config.optimizer
    muon, adamw, excluded = split_parameters(model.named_parameters(remove_duplicate=False), settings.muon_exclude)
    if not muon:
        raise ConfigError("[optimizer] name = 'Muon' found no block matrix to train (attention wq/wk/wv/wo, "
                          "feed_forward w1/w2/w3) on this rank; use AdamW, or fewer muon_exclude patterns.")
    optimizer = MuonWithAdamW(
        [p for _, p in muon], [p for _, p in adamw], lr=settings.lr, weight_decay=settings.weight_decay,
        betas=(0.9, 0.95), eps=settings.eps, foreach=_implementation_kwargs(settings.implementation)["foreach"],
        muon_lr=settings.muon_lr if settings.muon_lr is not None else settings.lr,
        muon_weight_decay=(settings.muon_weight_decay if settings.muon_weight_decay is not None
                           else settings.weight_decay),
        momentum=settings.muon_momentum, nesterov=settings.muon_nesterov, ns_steps=settings.muon_ns_steps,
        adjust_lr_fn=settings.muon_adjust_lr_fn, ns_dtype=settings.muon_ns_dtype,
        compile_newton_schulz=compiled)
    logger.info("Muon: %s", optimizer.owners.describe())
    return optimizer


@dataclass
class WarmupStableDecay:
    """The LR multiplier of a warmup -> stable -> decay (WSD) schedule, as a picklable callable.

    ``LambdaLR`` calls it with ``last_epoch`` = the number of scheduler steps taken so far; the value it
    returns is used by the next optimizer step, whose 1-based index is ``s = last_epoch + 1``. With
    ``W = warmup_steps``, ``D = decay_steps``, ``N = total_steps``, ``m = min_lr_factor``:

    * warmup,  ``1 <= s <= W``:          ``s / (W + 1)``  (never 0, so the first step already learns)
    * stable,  ``W < s <= N - D``:       ``1``
    * decay,   ``N - D < s <= N``:        ``m + (1 - m) * g(p)`` with ``p = (s - (N - D)) / (D + 1)`` and
      ``g(p) = 1 - p`` (linear), ``1 - sqrt(p)`` (sqrt), ``(1 + cos(pi * p)) / 2`` (cosine). Like the
      warmup it excludes both end points: the first decay step is just below 1, the last just above ``m``,
      so no step is wasted at lr 0.
    * after,   ``s > N``:                 ``m`` (the value left behind after the final scheduler step)

    ``decay_type = "constant"`` (or ``D = 0``) keeps 1 after warmup. The fields are plain attributes, so
    ``LambdaLR.state_dict()`` saves them and ``load_state_dict`` restores them.
    """

    warmup_steps: int
    decay_steps: int
    total_steps: int
    decay_type: str = "linear"
    min_lr_factor: float = 0.0

    def __call__(self, last_epoch: int) -> float:
        return self.at(last_epoch + 1)

    def at(self, step: float) -> float:
        """The multiplier of the ``step``-th step (a float under stages: ``StagedWarmupStableDecay``)."""
        if step <= self.warmup_steps:
            return step / (self.warmup_steps + 1)
        if self.decay_type == "constant":
            return 1.0
        decay_start = self.total_steps - self.decay_steps
        if step <= decay_start:
            return 1.0
        if step > self.total_steps:
            return self.min_lr_factor
        progress = (step - decay_start) / (self.decay_steps + 1)
        if self.decay_type == "linear":
            remaining = 1.0 - progress
        elif self.decay_type == "sqrt":
            remaining = 1.0 - math.sqrt(progress)
        else:  # cosine
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * remaining


@dataclass
class StagedWarmupStableDecay(WarmupStableDecay):
    """``WarmupStableDecay`` on the tokens' clock, for a run whose stages change the batch or seq_len: step ``s``
    is placed at ``x = tokens after s steps / tokens of a first-stage step`` (``core/stages.py``), and the warmup,
    decay start and end are the ``x`` of their steps. While no stage changed the tokens per step ``x = s`` exactly,
    so the values are ``WarmupStableDecay``'s. ``stage_starts``: (start step, start tokens, tokens per step) of
    each stage (plain tuples: ``LambdaLR.state_dict`` saves them)."""

    stage_starts: tuple[tuple[int, int, int], ...] = ()

    def __call__(self, last_epoch: int) -> float:
        return self.at(self.clock(last_epoch + 1))

    def clock(self, steps: float) -> float:
        start_step, start_tokens, per_step = [row for row in self.stage_starts if row[0] < steps or row[0] == 0][-1]
        return (start_tokens + (steps - start_step) * per_step) / self.stage_starts[0][2]


def staged_schedule(stages: StagePlan, schedule: WarmupStableDecay) -> StagedWarmupStableDecay:
    """``schedule`` (warmup, decay, total in steps) carried onto the tokens' clock of ``stages``; a stage with
    ``lr_decay`` starts the decay."""
    rows = tuple((stage.start_step, stage.start_tokens, stage.tokens_per_step) for stage in stages.stages)
    clock = StagedWarmupStableDecay(stage_starts=rows, **vars(schedule)).clock
    total = clock(schedule.total_steps)
    decay_start = stages.decay_start_step
    decay_start = clock(decay_start) if decay_start is not None else clock(schedule.total_steps - schedule.decay_steps)
    decay_start = min(decay_start, total)  # a decay stage after this run's last step: planned for a later part
    return StagedWarmupStableDecay(
        warmup_steps=clock(schedule.warmup_steps), decay_steps=total - decay_start, total_steps=total,
        decay_type=schedule.decay_type, min_lr_factor=schedule.min_lr_factor, stage_starts=rows)


def decay_steps_for(steps: int, warmup_steps: int, decay_ratio: float | None) -> int:
    """Length of the decay phase: ``round(decay_ratio * steps)`` (Python rounding, half to even), or every
    step after warmup when ``decay_ratio`` is None."""
    return steps - warmup_steps if decay_ratio is None else round(decay_ratio * steps)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
    stages: StagePlan | None = None,
) -> LambdaLR:
    """A ``LambdaLR`` driven by :class:`WarmupStableDecay` (see there for the exact formula).

    ``decay_ratio`` < 1 - warmup share leaves a stable phase at the peak LR between warmup and decay (WSD).
    """
    if steps <= 0:
        raise ConfigError(f"[training] steps = {steps!r} is impossible; use a positive number of steps.")
    if warmup_steps < 0:
        raise ConfigError(f"[lr_scheduler] warmup_steps = {warmup_steps!r} is impossible; use a value >= 0.")
    if decay_type not in DECAY_TYPES:
        raise ConfigError(
            f"[lr_scheduler] decay_type = {decay_type!r} is not supported; "
            f"use one of {', '.join(DECAY_TYPES)}."
        )
    if decay_ratio is not None and not 0 <= decay_ratio <= 1:
        raise ConfigError(
            f"[lr_scheduler] decay_ratio = {decay_ratio!r} is impossible; use none or a fraction in [0, 1]."
        )
    if not 0 <= min_lr_factor <= 1:
        raise ConfigError(
            f"[lr_scheduler] min_lr_factor = {min_lr_factor!r} is impossible; use a fraction in [0, 1]."
        )
    decay_steps = 0 if decay_type == "constant" else decay_steps_for(steps, min(warmup_steps, steps), decay_ratio)
    if warmup_steps + decay_steps > steps:
        # A short run (the first thing people try): keep the decay, shorten the warmup to what is left.
        shortened = steps - decay_steps
        logger.warning(
            "[lr_scheduler] warmup_steps = %d plus %d decay steps (decay_ratio = %s) exceed [training] steps = %d: "
            "warmup shortened to %d steps for this run", warmup_steps, decay_steps, decay_ratio, steps, shortened)
        warmup_steps = shortened
    schedule = WarmupStableDecay(
        warmup_steps=warmup_steps, decay_steps=decay_steps, total_steps=steps,
        decay_type=decay_type, min_lr_factor=min_lr_factor,
    )
    return LambdaLR(optimizer, schedule if stages is None else staged_schedule(stages, schedule))


def lr_scheduler_from_config(config: JobConfig, optimizer: torch.optim.Optimizer,
                             stages: StagePlan | None = None) -> LambdaLR:
    """``build_lr_scheduler`` with the ``[lr_scheduler]`` section's settings over ``[training] steps``; with
    ``stages``, on their tokens' clock (``staged_schedule``)."""
    settings = config.lr_scheduler
    decay_at_stage = stages is not None and stages.decay_start_step is not None  # decay_ratio is none then
    return build_lr_scheduler(optimizer, steps=config.training.steps, warmup_steps=settings.warmup_steps,
                              decay_ratio=0.0 if decay_at_stage else settings.decay_ratio,
                              decay_type=settings.decay_type, min_lr_factor=settings.min_lr_factor, stages=stages)


def load_lr_scheduler_position(lr_scheduler: LambdaLR, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
                               ) -> None:
    """Restore a saved ``LambdaLR``'s position (``saved``: its ``state_dict()``) but keep this run's schedule shape
    (warmup, decay, total steps), so a run resumed with more ``[training] steps`` follows its new schedule;
    unchanged, the values are identical."""
    saved_shapes = saved.get("lr_lambdas") or []
    saved = {**saved, "lr_lambdas": [None] * len(saved_shapes)}
    if len(saved.get("base_lrs", [])) != len(optimizer.param_groups):  # saved by another optimizer (AdamW -> Muon)
        logger.warning("checkpoint: the saved schedule drove %d parameter group(s), this optimizer has %d: its "
                       "position continues with this run's learning rates", len(saved.get("base_lrs", [])),
                       len(optimizer.param_groups))
        saved = {**{k: v for k, v in saved.items() if k not in ("base_lrs", "_last_lr")}, "lr_lambdas": []}
        saved_shapes = []
    lr_scheduler.load_state_dict(saved)
    for group, base_lr, schedule, saved_shape in zip(
        optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas,
        [*saved_shapes, *[None] * len(optimizer.param_groups)], strict=False,
    ):
        if saved_shape is not None and saved_shape != vars(schedule):
            logger.warning("checkpoint: the LR schedule changed since the save (%s -> %s); following the new "
                           "one from step %d", saved_shape, vars(schedule), lr_scheduler.last_epoch + 1)
        group["lr"] = base_lr * schedule(lr_scheduler.last_epoch)  # what LambdaLR.step() computes
