"""How a global batch is made of local batches: the one rule the trainer and the dry run share."""

from __future__ import annotations

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
