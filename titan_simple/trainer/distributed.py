"""Process-group set-up and tear-down: CUDA + NCCL when a GPU is present, CPU + gloo otherwise.

Before CUDA starts and before the process group exists, ``prepare_process_environment`` sets what torch reads
from the environment only once: the CUDA allocator's expandable segments and NCCL's error handling and flight
recorder (a user's own value of any of these variables is kept). Collectives wait ``[comm] init_timeout_seconds``
for their peers until the first training step has ended, then ``train_timeout_seconds`` (``set_timeouts``).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_simple.parallel.torch_private import set_process_group_timeout, use_one_gloo_worker_thread

if TYPE_CHECKING:
    from titan_simple.config import JobConfig

logger = logging.getLogger(__name__)


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


def init_process_group(info: DistInfo, timeout_seconds: int = 1800) -> None:
    """Join the process group. The timeout bounds how long a collective of the default group waits for a dead
    peer, so a crashed rank makes the others fail within it rather than hang forever; the mesh's groups get theirs
    from ``set_timeouts`` (torch gives a new group its backend's default, 10 min for NCCL, not this one). Gloo
    groups, on any device, run their collectives on one worker thread (``use_one_gloo_worker_thread``: with two,
    they abort now and then)."""
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.world_size > 1 and not dist.is_initialized():
        use_one_gloo_worker_thread()  # every gloo group, also the async checkpoint's beside NCCL
        dist.init_process_group(
            backend="nccl" if info.device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_seconds),
            device_id=info.device if info.device.type == "cuda" else None,
        )


def set_timeouts(groups: Sequence[dist.ProcessGroup], seconds: float) -> None:
    """From now on, collectives of the default group and of ``groups`` wait at most ``seconds`` for their peers
    (NCCL and gloo alike). The caller makes sure every rank has got this far: a rank still in a slow first step
    would otherwise meet peers already on a shorter timeout."""
    if not dist.is_initialized():
        return
    for group in [None, *groups]:
        set_process_group_timeout(group, seconds)


# ------------------------------------------------------------------------------------------ environment

# The CUDA caching allocator's settings, read once when CUDA initializes (torch 2.13: c10/cuda/
# CUDAAllocatorConfig.h:133-150 reads PYTORCH_CUDA_ALLOC_CONF first, then PYTORCH_ALLOC_CONF; the device-generic
# AcceleratorAllocatorConfig, which holds expandable_segments, reads them in the same order: checked on CPU).
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_environment(environ: Mapping[str, str], expandable_segments: bool) -> dict[str, str]:
    """The allocator variable to set: expandable segments, unless ``[training] expandable_segments = false`` or
    the user configured the allocator (either variable, any value: theirs is kept whole)."""
    if not expandable_segments or any(name in environ for name in ALLOCATOR_VARIABLES):
        return {}
    return {ALLOCATOR_VARIABLES[0]: EXPANDABLE_SEGMENTS}


# NCCL settings as (names torch 2.13 reads for one setting, value). Read when ProcessGroupNCCL and its flight
# recorder start (torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:67-75, 115-116; FlightRecorder.hpp
# :110-113 reads TORCH_FR_BUFFER_SIZE, then TORCH_NCCL_TRACE_BUFFER_SIZE; the dump file prefix is
# TORCH_FR_DUMP_TEMP_FILE or the older TORCH_NCCL_DEBUG_INFO_TEMP_FILE, both in libtorch_cpu.so's flight recorder,
# default /tmp/nccl_trace_rank_). We set every name of a setting, so any torch reads the same value; if the user
# set any of them, we set none. ASYNC_ERROR_HANDLING=3 (tear down without aborting the communicators) is torch's
# own default and the mode that still writes the flight recorder's dump (1 aborts first).
# NONBLOCKING_TIMEOUT (fault tolerance only): how long an operation on a non-blocking communicator -- torchft's
# replica group's -- may take; torch reads it once per process, so it is set here, before any group exists, from
# [fault_tolerance] timeout_seconds (torchft would set it when its group is built, after ours).
def _nccl_settings(trace_buf_size: int, trace_prefix: str,
                   nonblocking_timeout: float | None = None) -> list[tuple[tuple[str, ...], str]]:
    settings = [(("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "3"),
                (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(trace_buf_size))]
    if nonblocking_timeout is not None:
        settings.append((("TORCH_NCCL_NONBLOCKING_TIMEOUT",), str(max(1, round(nonblocking_timeout)))))
    if trace_buf_size > 0:
        settings += [(("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
                     (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), trace_prefix)]
    return settings


@dataclass
class EnvironmentChanges:
    """What ``prepare_process_environment`` set, and the user's values it kept, by variable name."""

    set: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


def nccl_environment(environ: Mapping[str, str], trace_buf_size: int, trace_prefix: str,
                     nonblocking_timeout: float | None = None) -> EnvironmentChanges:
    """The NCCL variables to set (error handling, flight recorder size, dump on timeout, dump file prefix, and with
    fault tolerance the non-blocking timeout) and the user's own values that stay."""
    changes = EnvironmentChanges()
    for names, value in _nccl_settings(trace_buf_size, trace_prefix, nonblocking_timeout):
        users = {name: environ[name] for name in names if name in environ}
        if users:
            changes.kept.update(users)
        else:
            changes.set.update(dict.fromkeys(names, value))
    return changes


def prepare_process_environment(config: JobConfig, device_type: str,
                                environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set the allocator and NCCL variables for this run before CUDA initializes and before the process group
    exists (CUDA only: gloo and the CPU allocator read none of them); return the log lines saying what was set,
    what was kept, and the timeouts."""
    environ = os.environ if environ is None else environ
    comm = config.comm
    timeouts = (f"timeouts {comm.init_timeout_seconds} s until the first step has ended, then "
                f"{comm.train_timeout_seconds} s")
    if device_type != "cuda":
        return [f"comm: gloo, {timeouts}"]
    allocator = allocator_environment(environ, config.training.expandable_segments)
    if allocator and torch.cuda.is_initialized():
        logger.warning("CUDA started before %s was set: the allocator keeps its defaults.", ALLOCATOR_VARIABLES[0])
    lines = [_apply("allocator", allocator, {n: environ[n] for n in ALLOCATOR_VARIABLES if n in environ}, environ)]
    traces = Path(config.job.dump_folder) / comm.save_traces_folder
    ft = config.fault_tolerance
    nccl = nccl_environment(environ, comm.trace_buf_size, str(traces / "rank_"),
                            nonblocking_timeout=ft.timeout_seconds if ft.enable else None)
    if comm.trace_buf_size > 0:
        traces.mkdir(parents=True, exist_ok=True)
    lines.append(_apply(f"comm: nccl, {timeouts}", nccl.set, nccl.kept, environ))
    return lines


def _apply(what: str, to_set: Mapping[str, str], kept: Mapping[str, str], environ: MutableMapping[str, str]) -> str:
    """Set ``to_set`` in ``environ``; the log line naming both what was set and what was kept."""
    environ.update(to_set)
    parts = [what]
    if to_set:
        parts.append("set " + ", ".join(f"{k}={v}" for k, v in to_set.items()))
    if kept:
        parts.append("kept yours: " + ", ".join(f"{k}={v}" for k, v in kept.items()))
    if len(parts) == 1:
        parts.append("torch's defaults")
    return " | ".join(parts)


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
