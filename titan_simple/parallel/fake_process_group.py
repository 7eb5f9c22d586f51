"""A process group that pretends to be rank ``r`` of ``N`` without any peers, for the dry run and the precompile.

PyTorch ships a "fake" c10d backend for exactly this (one process acting as one rank of a large job: every
collective returns at once and moves no data), but only under ``torch.testing._internal``: its store comes from
``parallel/torch_private.py`` (``fake_store``), guarded with the package's other private APIs.
"""

from __future__ import annotations

import torch.distributed as dist

from titan_simple.parallel.torch_private import fake_store


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of a ``world_size``-rank job whose collectives are no-ops.

    Replaces any default process group already initialized (a dry run is a fresh, single process)."""
    store = fake_store()  # registers the "fake" backend (torch_private.py: a private torch module)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
