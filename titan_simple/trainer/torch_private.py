"""The private torch APIs of the trainer's services (``titan_simple.trainer``), all imported here; checked with
torch 2.13 (``tests/test_torch_private.py`` checks every ``PRIVATE_APIS`` entry and that no other module of the
package imports a private torch name).

CUDA memory snapshots: ``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot`` are private but the
documented way to take one (https://pytorch.org/docs/stable/torch_cuda_memory.html).
"""

from __future__ import annotations

import torch.cuda.memory as cuda_memory
from torch.cuda.memory import _dump_snapshot, _record_memory_history

MAX_MEMORY_EVENTS = 100_000  # allocation events kept by the CUDA recorder (a ring buffer; ~ tens of MB)

# (owner, attribute, why we need it). The guard test checks each one with hasattr on the owner.
PRIVATE_APIS: tuple[tuple[object, str, str], ...] = (
    (cuda_memory, "_record_memory_history", "profiling.py: record every CUDA allocation for memory snapshots"),
    (cuda_memory, "_dump_snapshot", "profiling.py: write a memory snapshot for pytorch.org/memory_viz"),
)


def start_recording_cuda_memory(max_entries: int = MAX_MEMORY_EVENTS) -> None:
    """Record every CUDA allocation and free, with Python and C++ stacks, for later snapshots."""
    _record_memory_history(enabled="all", max_entries=max_entries)


def stop_recording_cuda_memory() -> None:
    _record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded history and the allocator's current state as a pickle for pytorch.org/memory_viz."""
    _dump_snapshot(path)
