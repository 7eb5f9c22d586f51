"""Process-group set-up and tear-down: CUDA + NCCL when a GPU is present, CPU + gloo otherwise."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def detect_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def read_launch_environment() -> DistInfo:
    """Rank and world size as ``torchrun`` sets them (plain ``python`` = one rank); no communication yet,
    so configuration errors can be reported before any process group exists."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=detect_device(local_rank))


def init_process_group(info: DistInfo, timeout_seconds: int = 600) -> None:
    """Join the process group. The timeout bounds how long a collective waits for a dead peer, so a
    crashed rank makes the others fail within it rather than hang forever."""
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if info.device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_seconds),
            device_id=info.device if info.device.type == "cuda" else None,
        )


def exit_process(code: int) -> None:
    """Leave without the interpreter's teardown when several processes ran (after ``shutdown_distributed``).
    The process group is destroyed by then, but gloo's C++ threads can still own tensors whose release needs
    the GIL while the interpreter is torn down, which now and then aborts a process that finished fine (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#179291; seen in CI)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)


def shutdown_distributed(clean: bool = True) -> None:
    """Barrier, then destroy: leaving the group to die with the interpreter aborts gloo runs now and then.
    After a failure (``clean=False``) the peers may be gone, so skip the barrier."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
