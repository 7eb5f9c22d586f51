"""How a global batch is made of local batches, and which rows each data-parallel rank reads: the rules the trainer
and the dry run share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_simple.errors import ConfigError


def accumulation_steps(global_batch_size: int, local_batch_size: int, dp: int) -> int:
    """Microbatches per step on each data-parallel rank: ``global_batch_size / (local_batch_size x dp)``
    (``-1``: one). Raises the one-line config error when the division is not exact."""
    per_step = local_batch_size * dp
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_step:
        raise ConfigError(
            f"[training] global_batch_size = {global_batch_size} is not a multiple of local_batch_size "
            f"x data-parallel degree = {local_batch_size} x {dp} = {per_step}; "
            f"choose a multiple of {per_step} or -1."
        )
    return global_batch_size // per_step


@dataclass(frozen=True)
class DataOrder:
    """The layout-invariant order (``data/sample_index.py``): step s, row r reads global sample
    ``consumed + s x global_rows + r``; each data-parallel rank reads its block of rows."""

    global_rows: int  # sequences per optimizer step: local batch x dp x accumulation
    shuffle_seed: int | None  # None: documents in store order
    cache: Path  # where the token stores are (data/token_store.py)
    ranks: int = 1  # the data-parallel ranks each global batch is split over (every replica group's)
    first_rank: int = 0  # this group's first one (fault tolerance: group g reads the block of ranks g x dp ..)

    def rank(self, dp_rank: int) -> int:
        """The block of each global batch that data-parallel rank ``dp_rank`` of this group reads."""
        return self.first_rank + dp_rank
