"""A run's stages, resolved: from which step each one runs, with which batch, seq_len and mixture weights.

Stage 0 is ``[training]`` itself; each ``[[training.stages]]`` entry starts a new one at a step, or at the first step
boundary where the tokens consumed reach its ``start_tokens``, and changes what it names (the rest carries over).
Everything is known at plan time, because a step's tokens are its global batch x seq_len: the table maps every step
to its stage, its tokens and the global samples consumed before it. The data position (samples consumed), the
learning-rate schedule (``core/optim.py``: tokens, not steps) and the checkpoint's record of the past stages
(``data/staged.py``) all read this table, the same on every layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from titan_simple.config import JobConfig
from titan_simple.config.stage_checks import stage_label
from titan_simple.core.batching import accumulation_steps
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import ModelArgs, flops_per_token
from titan_simple.parallel.dims import ParallelDims, validate_parallelism


@dataclass(frozen=True)
class Stage:
    number: int  # 0: [training]'s own settings
    name: str
    start_step: int  # steps taken before its first step
    start_tokens: int  # tokens consumed before its first step
    start_samples: int  # global samples consumed before its first step
    global_rows: int  # sequences per optimizer step
    seq_len: int
    accumulation_steps: int  # microbatches of local_batch_size per step on each data-parallel rank
    weights: tuple[float, ...]  # the mixture's weights, in [[training.mixture]] order (): one dataset
    lr_decay: bool  # the learning rate's decay starts here

    @property
    def tokens_per_step(self) -> int:
        return self.global_rows * self.seq_len

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of a stage that has started (resuming refuses a change of it)."""
        return {"start_step": self.start_step, "global_batch_size": self.global_rows, "seq_len": self.seq_len,
                "weights": list(self.weights), "lr_decay": self.lr_decay}


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    steps: int  # [training] steps

    def at_step(self, step: int) -> Stage:
        """The stage of the ``step``-th step (1-based)."""
        return [stage for stage in self.stages if stage.start_step < step][-1] if step > 0 else self.stages[0]

    def tokens_after(self, steps: int) -> int:
        """Tokens consumed after ``steps`` steps."""
        stage = self.at_step(steps)
        return stage.start_tokens + (steps - stage.start_step) * stage.tokens_per_step

    def samples_after(self, steps: int) -> int:
        """Global samples consumed after ``steps`` steps."""
        stage = self.at_step(steps)
        return stage.start_samples + (steps - stage.start_step) * stage.global_rows

    def stage_of_sample(self, sample: int) -> Stage:
        """The stage global sample ``sample`` (counted from 0 over the whole run) is read in."""
        return [stage for stage in self.stages if stage.start_samples <= sample][-1]

    def flops_per_token(self, step: int, first: float, args: ModelArgs) -> float:
        """The training FLOPs per token at step ``step``'s seq_len, from ``first``, those at the first stage's:
        attention's share grows with the sequence (``models/llama3.flops_per_token``)."""
        seq_len, first_seq_len = self.at_step(step).seq_len, self.stages[0].seq_len
        return first + flops_per_token(args, 0, seq_len) - flops_per_token(args, 0, first_seq_len)

    @property
    def decay_start_step(self) -> int | None:
        return next((stage.start_step for stage in self.stages if stage.lr_decay), None)

    def describe(self, source_names: Sequence[str]) -> list[str]:
        """The plan's table of the stages (before the first step)."""
        lines = [f"  stages:  {'':<10} {'from step':>9} {'tokens':>13} {'batch':>7} {'seq_len':>8} "
                 f"{'accumulation':>13}  mixture"]
        for stage in self.stages:
            mixture = ", ".join(f"{name} {weight:g}" for name, weight in zip(source_names, stage.weights,
                                                                            strict=True)) or "-"
            after = " (after the last step)" if stage.start_step >= self.steps else ""
            decay = "; lr decay starts" if stage.lr_decay else ""
            lines.append(f"    {stage.name:<15.15} {stage.start_step + 1:>9} {stage.start_tokens:>13,} "
                         f"{stage.global_rows:>7} {stage.seq_len:>8} {stage.accumulation_steps:>13}  "
                         f"{mixture}{decay}{after}")
        return lines


def longest_seq_len(config: JobConfig) -> int:
    """The longest sequence any stage trains (the model's RoPE table is built that long)."""
    return max([config.training.seq_len, *(stage.seq_len for stage in config.training.stages)])


def plan_stages(config: JobConfig, dims: ParallelDims, model_args: ModelArgs, data_ranks: int) -> StagePlan | None:
    """The stage table of a run with ``[[training.stages]]`` (None without), each stage checked against the layout."""
    if not config.training.stages:
        return None

    def check_seq_len(seq_len: int) -> None:
        if seq_len != config.training.seq_len and dims.pp > 1:
            raise ConfigError(f"seq_len {seq_len}: pipeline parallel infers the shapes its stages send once, so a "
                              "run with pipeline_parallel_degree > 1 keeps one seq_len; train the longer sequences as "
                              "a run of their own, started from this one's weights (--checkpoint.initial_load_path "
                              "<step folder>).")
        training = dataclasses.replace(config.training, seq_len=seq_len)
        try:
            validate_parallelism(dims, model_args, dataclasses.replace(config, training=training))
        except ConfigError as error:
            raise ConfigError(str(error).replace("[training] seq_len", "seq_len")) from None

    return resolve_stages(config, data_ranks, check_seq_len)


def resolve_stages(config: JobConfig, data_ranks: int, check_seq_len: Any) -> StagePlan:
    """The table of ``config``'s stages for ``data_ranks`` data-parallel readers of each global batch.
    ``check_seq_len(seq_len)`` raises the layout's one-line error for a length it cannot run. Raises the one-line
    ConfigError of a stage the layout cannot run, at plan time."""
    training = config.training
    sources = training.mixture
    accumulation = accumulation_steps(training.global_batch_size, training.local_batch_size, data_ranks)
    stages = [Stage(number=0, name="start", start_step=0, start_tokens=0, start_samples=0,
                    global_rows=training.local_batch_size * data_ranks * accumulation, seq_len=training.seq_len,
                    accumulation_steps=accumulation, weights=tuple(entry.weight for entry in sources), lr_decay=False)]
    for number, entry in enumerate(training.stages, start=1):
        label = f"[[training.stages]] '{stage_label(number, entry)}'"
        before = stages[-1]
        start_step = entry.start_step if entry.start_step > 0 else _first_step_with(entry.start_tokens, before)
        if start_step <= before.start_step:
            raise ConfigError(f"{label} starts at step {start_step + 1}, not after the stage before it (from step "
                              f"{before.start_step + 1}); list the stages in the order they start.")
        rows = entry.global_batch_size if entry.global_batch_size > 0 else before.global_rows
        try:
            accumulation = accumulation_steps(rows, training.local_batch_size, data_ranks)
        except ConfigError as error:
            raise ConfigError(f"{label}: {str(error).replace('[training] ', '')}") from None
        seq_len = entry.seq_len if entry.seq_len > 0 else before.seq_len
        try:
            check_seq_len(seq_len)
        except ConfigError as error:
            raise ConfigError(f"{label}: {error}") from None
        weights = tuple(entry.mixture_weights.get(source.name, weight)
                        for source, weight in zip(sources, before.weights, strict=True))
        if sources and not any(w > 0 for w in weights):
            raise ConfigError(f"{label}: mixture_weights leave no source with a positive weight; give one a share.")
        if entry.lr_decay and start_step < config.lr_scheduler.warmup_steps:
            raise ConfigError(f"{label}: lr_decay starts the decay at step {start_step + 1}, inside the warmup "
                              f"([lr_scheduler] warmup_steps = {config.lr_scheduler.warmup_steps}); start the stage "
                              "after the warmup or shorten it.")
        steps_before = start_step - before.start_step
        stages.append(Stage(
            number=number, name=entry.name or f"stage {number}", start_step=start_step,
            start_tokens=before.start_tokens + steps_before * before.tokens_per_step,
            start_samples=before.start_samples + steps_before * before.global_rows, global_rows=rows, seq_len=seq_len,
            accumulation_steps=accumulation, weights=weights, lr_decay=entry.lr_decay))
    return StagePlan(stages=tuple(stages), steps=training.steps)


def _first_step_with(tokens: int, stage: Stage) -> int:
    """The first step boundary, counted in steps from the run's start, where ``tokens`` have been consumed."""
    remaining = max(tokens - stage.start_tokens, 0)
    return stage.start_step + -(-remaining // stage.tokens_per_step)
