"""A process group that pretends to be rank ``r`` of ``N`` without any peers: the dry run's only private API.

PyTorch ships a "fake" c10d backend for exactly this (one process acting as one rank of a large job: every
collective returns at once and moves no data), but only under ``torch.testing._internal``. Importing that
module registers the ``"fake"`` backend. Everything the dry run needs from it goes through this file, and
``tests/test_dry_run.py::test_fake_process_group_api_exists`` fails loudly when a torch upgrade moves it.
"""

from __future__ import annotations

import torch.distributed as dist


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of a ``world_size``-rank job whose collectives are no-ops.

    Replaces any default process group already initialized (a dry run is a fresh, single process)."""
    # Private (torch 2.13): registers the "fake" backend on import and provides the matching store.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
