"""A weighted mixture of token stores: global sample ``g`` comes from one source, the same on every layout.

The weights are shares of **tokens**. Every sample of a step has ``seq_len + 1`` tokens whatever its source, so a
share of samples is the same share of tokens. The shares are made exact fractions (``0.17`` is 17/100; weights
``1, 1, 1`` are thirds); over a **period** of ``D`` global samples, ``D`` their common denominator, source ``k``
gets exactly ``share_k x D`` of them. Inside a period the sources take turns by Tijdeman's rule for the
chairman assignment problem: at every prefix of ``n`` samples source ``k`` has had within ``1 - 1/(2K - 2)`` of
``share_k x n`` samples (R. Tijdeman, 1980), so after any number of steps the tokens each source gave are
within one sequence of its share. The period is computed once (a few microseconds per sample); sample ``g``
is then a lookup: period ``g // D``, place ``g % D``. No random draw: the blend depends on the weights only,
as Megatron-LM's blended dataset index (a deterministic greedy); which window a source gives is its own
seeded ``SampleIndex`` (its own epochs, reshuffled each epoch), so a small source repeats and a large one is
read in part.

Shares whose common denominator exceeds ``MAX_PERIOD`` (weights like 0.123456789) are rounded to
``1 / MAX_PERIOD`` (largest remainders, every source at least one sample a period), and the log says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from titan_simple.data.sample_index import SampleIndex
from titan_simple.errors import CheckpointError

logger = logging.getLogger(__name__)

MAX_PERIOD = 1 << 20


def exact_shares(weights: Sequence[float]) -> list[Fraction]:
    """The weights as exact fractions of their sum (``repr`` of a float is the decimal the user wrote)."""
    fractions = [Fraction(repr(float(w))) for w in weights]
    total = sum(fractions)
    return [f / total for f in fractions]


def period_counts(shares: Sequence[Fraction]) -> list[int]:
    """Samples of each source per period: the shares times their common denominator, or, when that exceeds
    ``MAX_PERIOD``, ``MAX_PERIOD`` samples apportioned by largest remainders."""
    period = math.lcm(*(s.denominator for s in shares))
    if period <= MAX_PERIOD:
        return [int(s * period) for s in shares]
    ideal = [s * MAX_PERIOD for s in shares]
    counts = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(shares)), key=lambda k: (-(ideal[k] - counts[k]), k))
    for k in by_remainder[:MAX_PERIOD - sum(counts)]:
        counts[k] += 1
    for k in range(len(counts)):  # a source with a weight is read, however small its share
        if counts[k] == 0 and shares[k] > 0:
            counts[k] = 1
            counts[counts.index(max(counts))] -= 1
    return counts


def blend_period(counts: Sequence[int]) -> np.ndarray:
    """``[sum(counts)]`` source ids: the order of one period, by Tijdeman's rule. At place ``n`` (1-based) the
    candidates are the sources owed at least ``delta = 1 / (2K - 2)`` of a sample (``share x n - taken``); the one
    whose deadline ``(taken + 1 - delta) / share`` comes first takes it (ties: the first source)."""
    read = [k for k, c in enumerate(counts) if c]  # a stage may leave a source out (weight 0)
    if len(read) < len(counts):
        return np.asarray(read, dtype=np.int64)[blend_period([counts[k] for k in read])]
    period, sources = sum(counts), len(counts)
    order = np.zeros(period, dtype=np.int64)
    if sources == 1:
        return order
    # In integers, so that every machine makes the same order: with scale = 2K - 2, source k is a candidate when
    # (c_k n - taken_k period) scale >= period, and its deadline is ((taken_k + 1) scale - 1) / c_k (x period/scale).
    scale, taken = 2 * sources - 2, [0] * sources
    for n in range(1, period + 1):
        best, best_num, best_den = -1, 0, 1
        for k, c in enumerate(counts):
            if c and (c * n - taken[k] * period) * scale >= period:
                num = (taken[k] + 1) * scale - 1
                if best < 0 or num * best_den < best_num * c:
                    best, best_num, best_den = k, num, c
        order[n - 1] = best
        taken[best] += 1
    return order


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture, opened: its name, share and sample index."""

    name: str
    share: Fraction
    index: SampleIndex


class MixtureIndex:
    """Samples of ``seq_len + 1`` tokens from several sources: ``sample(g)`` as ``SampleIndex.sample`` (so
    ``datasets.GlobalSamples``, resume and fault tolerance work unchanged: the position is still the number of
    global samples consumed)."""

    def __init__(self, sources: Sequence[MixtureSource], offsets: Sequence[int] | None = None,
                 epochs_said: list[int] | None = None) -> None:
        """``offsets``: each source's first sample; ``epochs_said``: the epochs already logged per source (indexes
        that read the same sources one after another share it, so a new epoch is said once)."""
        self.sources = list(sources)
        # where each source starts reading its own samples (a stage continues where the one before stopped)
        self.offsets = list(offsets) if offsets is not None else [0] * len(self.sources)
        self.per_period = period_counts([s.share for s in self.sources])
        self.order = blend_period(self.per_period)
        self.period = len(self.order)
        # the place of each sample among its source's samples of the period
        self.within = np.empty(self.period, dtype=np.int64)
        for k in range(len(self.sources)):
            where = np.flatnonzero(self.order == k)
            self.within[where] = np.arange(len(where))
        # validation reads one pass: the smallest source's epoch in mixture samples
        self.samples_per_epoch = min(s.index.samples_per_epoch * self.period // c
                                     for s, c in zip(self.sources, self.per_period, strict=True) if c)
        self._epochs_said = epochs_said if epochs_said is not None else [0] * len(self.sources)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, the source's own sample number) of global sample ``g``."""
        period, place = divmod(g, self.period)
        k = int(self.order[place])
        return k, period * self.per_period[k] + int(self.within[place])

    def sample(self, g: int) -> torch.Tensor:
        k, local = self.locate(g)
        return self.sources[k].index.sample(self.offsets[k] + local)

    def taken(self, consumed: int) -> list[int]:
        """Samples each source gave among the first ``consumed`` global samples."""
        period, place = divmod(consumed, self.period)
        head = np.bincount(self.order[:place], minlength=len(self.sources))
        return [period * c + int(h) for c, h in zip(self.per_period, head, strict=True)]

    def positions(self, consumed: int) -> list[int]:
        """Each source's own sample number after ``consumed`` global samples (its offset + what it gave)."""
        return [offset + taken for offset, taken in zip(self.offsets, self.taken(consumed), strict=True)]

    def epochs(self, consumed: int) -> list[float]:
        """Epochs of each source read after ``consumed`` global samples (1.5: once whole, then half again)."""
        return [p / s.index.samples_per_epoch for p, s in zip(self.positions(consumed), self.sources, strict=True)]

    def progress(self, consumed: int) -> list[tuple[str, int, float]]:
        """(name, tokens trained on, epochs) of each source after ``consumed`` global samples."""
        return [(s.name, taken * (s.index.window - 1), epochs) for s, taken, epochs
                in zip(self.sources, self.taken(consumed), self.epochs(consumed), strict=True)]

    def say_new_epochs(self, consumed: int) -> None:
        """Log, once per source and epoch, that a source has started reading itself again."""
        for k, (taken, source) in enumerate(zip(self.positions(consumed), self.sources, strict=True)):
            epoch = taken // source.index.samples_per_epoch
            if epoch > self._epochs_said[k]:
                self._epochs_said[k] = epoch
                logger.info("data: source '%s' is in its epoch %d (it has given %s samples of %s per epoch)",
                            source.name, epoch + 1, f"{taken:,}", f"{source.index.samples_per_epoch:,}")

    def describe(self) -> str:
        shares = ", ".join(f"{s.name} {float(s.share):.1%} ({s.index.store.num_tokens:,} tokens)"
                           for s in self.sources)
        rounded = "" if math.lcm(*(s.share.denominator for s in self.sources)) <= MAX_PERIOD else (
            f"; shares rounded to 1/{MAX_PERIOD:,}")
        return f"mixture of {len(self.sources)} sources by tokens: {shares}; period {self.period:,} samples{rounded}"


def mixture_record(index: MixtureIndex, consumed: int | None = None) -> dict[str, object]:
    """What a checkpoint keeps of a mixture: each source's name and share (as a fraction's text), and with
    ``consumed`` the samples each source gave until then."""
    record: dict[str, object] = {"shares": [(s.name, str(s.share)) for s in index.sources]}
    if consumed is not None:
        record["taken"] = dict(zip((s.name for s in index.sources), index.taken(consumed), strict=True))
    return record


def check_same_mixture(path: object, saved: dict[str, object] | None, now: dict[str, object] | None) -> None:
    """A checkpoint at ``path`` whose data record is ``saved`` (None or no shares: one dataset) resumed by a run
    whose record is ``now``: the blend is a function of the mixture from sample 0, so a run that names other sources
    or shares would read other samples for the steps already trained, and not continue. Raises the one-line
    error."""
    saved = saved if saved and saved.get("shares") else None
    now = now if now and now.get("shares") else None
    if (now and now["shares"]) == (saved and saved["shares"]):
        return

    def say(record: dict[str, object] | None) -> str:
        return "one dataset" if record is None else "the mixture " + ", ".join(
            f"{name} {share}" for name, share in record["shares"])

    raise CheckpointError(f"checkpoint {path} was trained on {say(saved)}, this run names {say(now)}: its data "
                          "position would not continue. Set the same data again, or start a new mix from its "
                          "weights with --checkpoint.exclude_from_loading dataloader.")
