"""Profiling: ``torch.profiler`` traces and memory snapshots, every ``[profiling] profile_freq`` steps.

    profiler = Profiler(config.profiling, dump_folder, rank=rank, device=device)
    profiler.start(first_step=0)
    for step in ...:
        with profiler.dump_on_oom(step):
            train_step(...)
        profiler.step(step)
    profiler.stop()

**Traces.** Each cycle of ``profile_freq`` steps, the profiler waits, warms up for ``profiler_warmup`` steps and
records the last ``profiler_active``; each rank then writes a Chrome/Perfetto JSON trace to
``<dump_folder>/<save_traces_folder>/iteration_N/rankR_trace.json`` (N: the step that ended the recording, a
multiple of ``profile_freq``). Open it at https://ui.perfetto.dev or chrome://tracing.

**Memory.** On CUDA the caching allocator records every allocation with its stack
(``torch.cuda.memory._record_memory_history``) and the history is dumped as a pickle
(``_dump_snapshot``) to ``<dump_folder>/<save_memory_snapshot_folder>/iteration_N/rankR_memory_snapshot.pickle``
every ``profile_freq`` steps, and to ``iteration_N_oom/`` when a step runs out of memory (then the error goes
on). Open it at https://pytorch.org/memory_viz. Other devices have no allocator history: there the profiler
records memory (``profile_memory=True``) and each recording's memory timeline is written as
``rankR_memory_timeline.json`` in the same folders: ``[times_us, sizes]``, where ``sizes[i]`` is the live bytes
at ``times_us[i]`` as ``[0, parameter, optimizer state, input, temporary, activation, gradient, autograd detail,
unknown]`` (torch 2.13's ``export_memory_timeline``, deprecated there in favour of the CUDA-only snapshot but
the only timeline off CUDA; exporting takes seconds). That timeline needs a single process: with several, gloo's
worker threads free tensors out of the profiler's sight and torch's analysis fails, so the plan refuses it
(``core/plan.py``, ``check_profiling``).

**Errors while writing.** torch calls ``on_trace_ready`` in the middle of a schedule transition; an exception
raised there leaves its profiler half-stopped, and the next ``stop()`` dies of SIGSEGV (torch 2.13, when the
next cycle starts with no wait step). A failed export is therefore held until the transition is over and raised
from ``step()`` / ``stop()``, with its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch
import torch.profiler

from titan_simple.config import Profiling
from titan_simple.trainer.torch_private import (
    dump_cuda_memory_snapshot,
    start_recording_cuda_memory,
    stop_recording_cuda_memory,
)

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------- profiler


class Profiler:
    """Traces and memory snapshots of a training run; every method is a no-op when nothing is enabled."""

    def __init__(self, config: Profiling, dump_folder: str, *, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.is_cuda = device.type == "cuda"
        self.traces_folder = os.path.join(dump_folder, config.save_traces_folder)
        self.snapshot_folder = os.path.join(dump_folder, config.save_memory_snapshot_folder)
        self.cuda_snapshots = config.enable_memory_snapshot and self.is_cuda
        # Without a CUDA allocator history, memory comes from the profiler: it runs for that alone if need be.
        self.memory_timeline = config.enable_memory_snapshot and not self.is_cuda
        self.save_traces = config.enable_profiling
        self._profiler: torch.profiler.profile | None = None
        self._step = 0
        self._export_error: BaseException | None = None  # raised once torch's profiler is in a steady state

    @property
    def enabled(self) -> bool:
        return self.save_traces or self.config.enable_memory_snapshot

    def _folder(self, root: str, step: int, suffix: str = "") -> str:
        folder = os.path.join(root, f"iteration_{step}{suffix}")
        os.makedirs(folder, exist_ok=True)
        return folder

    def start(self, first_step: int = 0) -> None:
        """Begin before the step after ``first_step`` (0, or the step a checkpoint resumed from): recordings
        then still end on multiples of ``profile_freq``."""
        profiling_config = self.config
        self._step = first_step
        if self.cuda_snapshots:
            start_recording_cuda_memory()
            logger.info("profiling: CUDA memory snapshots every %d steps and on OOM to %s",
                        profiling_config.profile_freq, self.snapshot_folder)
        if not (self.save_traces or self.memory_timeline):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.is_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(
            skip_first=(-first_step) % profiling_config.profile_freq,
            wait=profiling_config.profile_freq - profiling_config.profiler_warmup - profiling_config.profiler_active,
            warmup=profiling_config.profiler_warmup,
            active=profiling_config.profiler_active,
        )
        # export_memory_timeline needs shapes and stacks besides the memory events.
        self._profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._trace_ready,
            profile_memory=self.memory_timeline, record_shapes=self.memory_timeline, with_stack=self.memory_timeline,
        )
        self._profiler.start()
        if self.save_traces:
            logger.info("profiling: traces of %d step(s) every %d steps to %s/iteration_N/rank%d_trace.json",
                        profiling_config.profiler_active, profiling_config.profile_freq, self.traces_folder, self.rank)
        if self.memory_timeline:
            logger.info("profiling: no CUDA here, so no allocator snapshot; writing the profiler's memory timeline "
                        "every %d steps to %s/iteration_N/rank%d_memory_timeline.json instead",
                        profiling_config.profile_freq, self.snapshot_folder, self.rank)

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        """torch's ``on_trace_ready``: never raises into torch (see the module docstring)."""
        try:
            self._write_recording(profiler)
        except BaseException as error:  # noqa: BLE001 -- re-raised by _raise_export_error
            self._export_error = error

    def _raise_export_error(self) -> None:
        if self._export_error is not None:
            error, self._export_error = self._export_error, None
            raise error

    def _write_recording(self, profiler: torch.profiler.profile) -> None:
        if self.save_traces:
            path = os.path.join(self._folder(self.traces_folder, self._step), f"rank{self.rank}_trace.json")
            profiler.export_chrome_trace(path)
            logger.info("profiling: wrote %s", path)
        if self.memory_timeline:
            path = os.path.join(self._folder(self.snapshot_folder, self._step), f"rank{self.rank}_memory_timeline.json")
            with _quiet_deprecation():
                profiler.export_memory_timeline(path, device="cpu")
            logger.info("profiling: wrote %s", path)

    def step(self, step: int) -> None:
        """Call after each training step with its number."""
        self._step = step
        if self._profiler is not None:
            self._profiler.step()
            self._raise_export_error()
        if self.cuda_snapshots and step % self.config.profile_freq == 0:
            self._dump_snapshot(step)

    def _dump_snapshot(self, step: int, suffix: str = "") -> None:
        path = os.path.join(self._folder(self.snapshot_folder, step, suffix), f"rank{self.rank}_memory_snapshot.pickle")
        dump_cuda_memory_snapshot(path)
        logger.info("profiling: wrote %s", path)

    @contextlib.contextmanager
    def dump_on_oom(self, step: int) -> Iterator[None]:
        """Around a training step: on ``torch.OutOfMemoryError`` dump a snapshot (CUDA), then re-raise."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.cuda_snapshots:
                logger.error("profiling: out of memory at step %d; dumping a memory snapshot", step)
                self._dump_snapshot(step, suffix="_oom")
            raise

    def stop(self) -> None:
        """End recording (a recording in progress is written out). Safe to call more than once."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
        if self.cuda_snapshots:
            stop_recording_cuda_memory()
            self.cuda_snapshots = False
        self._raise_export_error()


@contextlib.contextmanager
def _quiet_deprecation() -> Iterator[None]:
    """torch 2.13 marks export_memory_timeline deprecated in favour of the CUDA-only snapshot; off CUDA it is
    still the only memory timeline there is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*export_memory_timeline.*", category=FutureWarning)
        yield
