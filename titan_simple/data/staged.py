"""Global samples of a run with stages (``core/stages.py``): each stage reads its own blend, at its own seq_len.

Global sample ``g`` falls in the stage whose first sample is the last one at or before ``g``; inside the stage it
is sample ``g - start`` of the stage's ``MixtureIndex`` (one source for a single dataset), built with the stage's
weights and windows of the stage's seq_len + 1. Every source continues where the stage before left it: the same
sample number when the window length stays, else after the same number of its tokens, rounded up to a window of
the new length (the windows of another length are another cut of the epoch, so some of that epoch's text is read
twice and some not at all; the epoch count per source stays right). All of it follows from the stage table, so the
data position is still one number, the global samples consumed, the same on every layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch

from titan_simple.data.mixture import MixtureIndex, MixtureSource, check_same_mixture, exact_shares, mixture_record
from titan_simple.data.sample_index import SampleIndex
from titan_simple.errors import CheckpointError


class StagedIndex:
    """``sample(g)`` over a stage table (``plan``: a ``core/stages.StagePlan``; the data layer does not import the
    core); ``rows_at(consumed)``: the global batch of the step that starts there."""

    def __init__(self, plan: Any, names: Sequence[str], open_sources: Callable[[int], list[SampleIndex]],
                 mixed: bool) -> None:
        """``open_sources(seq_len)``: each source's ``SampleIndex`` of windows of ``seq_len + 1``; ``mixed``: the
        sources are ``[[training.mixture]]``'s (else one dataset, named ``names[0]``)."""
        self.plan, self.mixed = plan, mixed
        indexes: dict[int, list[SampleIndex]] = {}
        self.blends: list[MixtureIndex] = []
        offsets, epochs_said = [0] * len(names), [0] * len(names)  # a source's new epoch is said once, any stage
        for stage in plan.stages:
            if stage.seq_len not in indexes:
                indexes[stage.seq_len] = open_sources(stage.seq_len)
            if self.blends:
                before = plan.stages[stage.number - 1]
                offsets = self.blends[-1].positions(stage.start_samples - before.start_samples)
                if stage.seq_len != before.seq_len:  # the same tokens, in windows of the new length (rounded up)
                    offsets = [-(-p * (before.seq_len + 1) // (stage.seq_len + 1)) for p in offsets]
            shares = exact_shares(stage.weights) if mixed else [Fraction(1)]
            sources = [MixtureSource(name, share, index)
                       for name, share, index in zip(names, shares, indexes[stage.seq_len], strict=True)]
            self.blends.append(MixtureIndex(sources, offsets=offsets, epochs_said=epochs_said))
        self.sources = self.blends[0].sources  # the first stage's: what the checkpoint's mixture record names

    def _stage(self, consumed: int) -> tuple[int, int]:
        stage = self.plan.stage_of_sample(consumed)
        return stage.number, consumed - stage.start_samples

    def sample(self, g: int) -> torch.Tensor:
        number, local = self._stage(g)
        return self.blends[number].sample(local)

    def rows_at(self, consumed: int) -> int:
        return self.plan.stage_of_sample(consumed).global_rows

    def taken(self, consumed: int) -> list[int]:
        """Samples each source gave in all stages, after ``consumed`` global samples."""
        return [sum(column) for column in zip(*self._taken_per_stage(consumed), strict=True)]

    def _taken_per_stage(self, consumed: int) -> list[list[int]]:
        number, local = self._stage(consumed)
        stages = self.plan.stages
        return [blend.taken(stages[k + 1].start_samples - stages[k].start_samples if k < number else local)
                for k, blend in enumerate(self.blends[:number + 1])]

    def progress(self, consumed: int) -> list[tuple[str, int, float]]:
        """(name, tokens trained on, epochs) of each source after ``consumed`` global samples, all stages."""
        number, local = self._stage(consumed)
        tokens = [0] * len(self.sources)
        for stage, taken in zip(self.plan.stages, self._taken_per_stage(consumed), strict=False):
            tokens = [t + n * stage.seq_len for t, n in zip(tokens, taken, strict=True)]
        epochs = self.blends[number].epochs(local)
        return [(s.name, t, e) for s, t, e in zip(self.sources, tokens, epochs, strict=True)]

    def say_new_epochs(self, consumed: int) -> None:
        number, local = self._stage(consumed)
        self.blends[number].say_new_epochs(local)

    def describe(self) -> str:
        """The first stage's blend, then each later stage's shares where they change."""
        if not self.mixed:
            return (f"{self.sources[0].name} through {len(self.plan.stages)} stages, in windows of "
                    + ", ".join(str(length) for length in dict.fromkeys(s.seq_len for s in self.plan.stages))
                    + " tokens (+1)")
        lines, shares = [self.blends[0].describe()], [s.share for s in self.blends[0].sources]
        for stage, blend in zip(self.plan.stages[1:], self.blends[1:], strict=True):
            if [s.share for s in blend.sources] != shares:
                shares = [s.share for s in blend.sources]
                lines.append(f"from stage {stage.number} ({stage.name}): " + ", ".join(
                    f"{s.name} {float(s.share):.1%}" for s in blend.sources) + f", period {blend.period:,} samples")
        return "; ".join(lines)

    def record(self, consumed: int | None = None) -> dict[str, Any]:
        """The checkpoint's data record: the first stage's shares (a mixture's), each source's samples, and the
        settings of every stage that has started by ``consumed``."""
        record: dict[str, Any] = {"shares": [(s.name, str(s.share)) for s in self.sources] if self.mixed else []}
        if consumed is not None:
            record["taken"] = dict(zip((s.name for s in self.sources), self.taken(consumed), strict=True))
            record["stages"] = [stage.record() for stage in self.plan.stages if stage.start_samples < consumed
                                or stage.number == 0]
        return record

    def check_resume(self, path: object, saved: dict[str, Any] | None, consumed: int, step: int) -> None:
        """Refuse, in one line, a checkpoint whose past stages ran with other settings than this table's."""
        check_same_past_stages(path, (saved or {}).get("stages"), self.plan, consumed, step)


def data_record(index: object, consumed: int | None = None) -> dict[str, Any] | None:
    """What a checkpoint keeps of a mixture's or a staged run's data (None: one dataset, no stages)."""
    if isinstance(index, StagedIndex):
        return index.record(consumed)
    return mixture_record(index, consumed) if isinstance(index, MixtureIndex) else None


def check_data_record(path: object, saved: dict[str, Any] | None, index: object, position: dict[str, int],
                      step: int) -> None:
    """Refuse, in one line, to resume a checkpoint whose mixture or past stages this run would not continue
    (``position``: the saved ``consumed_samples`` and ``seq_len``)."""
    check_same_mixture(path, saved, data_record(index))
    if isinstance(index, StagedIndex):
        first = index.plan.stages[0].seq_len
        if position["seq_len"] != first:  # windows of another length: the samples would not continue
            raise CheckpointError(
                f"checkpoint {path} (step {step}) was trained with [training] seq_len {position['seq_len']}, this "
                f"run's first stage has {first}: with stages the data continues only from the same first seq_len. "
                "Set it back; a stage changes seq_len from a later step.")
        index.check_resume(path, saved, position["consumed_samples"], step)
    elif saved and len(saved.get("stages", [])) > 1:  # the stages were dropped: the steps would revert to stage 0's
        stage = saved["stages"][-1]
        raise CheckpointError(
            f"checkpoint {path} (step {step}) is in stage {len(saved['stages']) - 1} (global batch "
            f"{stage['global_batch_size']}, seq_len {stage['seq_len']}), and this config has no [[training.stages]]: "
            "its steps would go back to the first stage's settings. Give the config its stages again.")


def check_same_past_stages(path: object, saved: list[dict[str, Any]] | None, plan: Any, consumed: int,
                           step: int) -> None:
    """A checkpoint at ``path`` saved after ``step`` steps and ``consumed`` global samples, ``saved`` the records of
    the stages that had started (None: saved by a run without stages), resumed by a run whose table is ``plan``:
    the steps already trained must have run with this table's settings, or the data position and the schedule
    would not continue. Raises the one-line error."""
    now = [stage.record() for stage in plan.stages if stage.start_samples < consumed or stage.number == 0]
    fix = f"Set it back, and change what comes next with a stage that starts after step {step}."
    if saved is None and len(now) > 1:  # saved by a run without stages: only [training]'s settings ran
        raise CheckpointError(f"checkpoint {path} (step {step}) was trained without stages, and this config's stage "
                              f"'{plan.stages[len(now) - 1].name}' starts before it: a past stage cannot change on "
                              f"resume. {fix}")
    for number, (was, new) in enumerate(zip(saved or [], now, strict=False)):
        if was != new:
            changed = ", ".join(f"{key} {was.get(key)} -> {new[key]}" for key in new if was.get(key) != new[key])
            raise CheckpointError(f"checkpoint {path} (step {step}) trained stage {number} with other settings "
                                  f"({changed}): a past stage cannot change on resume. {fix}")
    if saved is not None and len(saved) != len(now):
        raise CheckpointError(f"checkpoint {path} (step {step}) had started {len(saved)} stage(s), this config "
                              f"starts {len(now)} by then: a past stage cannot change on resume. {fix}")
    if plan.samples_after(step) != consumed:
        raise CheckpointError(f"checkpoint {path} (step {step}) consumed {consumed:,} samples, this config's stages "
                              f"read {plan.samples_after(step):,} in {step} steps: the run before trained other "
                              f"batches. Give [training] and the stages the batches it trained with. {fix}")
