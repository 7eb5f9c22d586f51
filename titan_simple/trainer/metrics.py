"""Training metrics: throughput and MFU, memory, distributed loss reduction, and the logger that writes
them to the console, ``metrics.jsonl``, TensorBoard and Weights & Biases.

A metric has one name everywhere: the key of the dict passed to :meth:`MetricsLogger.log` is the
TensorBoard tag, the JSONL field and the W&B key (the constants below).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_simple.errors import ConfigError

if TYPE_CHECKING:
    from titan_simple.config import JobConfig
    from titan_simple.trainer.wandb_run import WandbOptions, WandbRun

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------- names

AVG_LOSS = "loss_metrics/global_avg_loss"
MAX_LOSS = "loss_metrics/global_max_loss"
GRAD_NORM = "grad_norm"
LR = "lr"
TOKENS_PER_SECOND = "throughput(tps)"
TFLOPS = "tflops"
MFU = "mfu(%)"
DATA_LOADING_SECONDS = "time_metrics/data_loading(s)"
DATA_LOADING_PERCENT = "time_metrics/data_loading(%)"
# A mixture's sources (data/mixture.py): data_sources/<name>/tokens and data_sources/<name>/epochs.
DATA_SOURCES = "data_sources/"
# ... and their held-out losses (trainer/validation.py): validation_metrics/<name>/loss and /perplexity.
VALIDATION_SOURCES = "validation_metrics/"
END_TO_END_SECONDS = "time_metrics/end_to_end(s)"
CUDA_MAX_ACTIVE_GIB = "memory/max_active(GiB)"
CUDA_MAX_ACTIVE_PERCENT = "memory/max_active(%)"
CUDA_MAX_RESERVED_GIB = "memory/max_reserved(GiB)"
CUDA_MAX_RESERVED_PERCENT = "memory/max_reserved(%)"
CUDA_NUM_ALLOC_RETRIES = "memory/num_alloc_retries"
CUDA_NUM_OOMS = "memory/num_ooms"
PEAK_RSS_GIB = "memory/peak_rss(GiB)"
PEAK_RSS_SINCE_START_GIB = "memory/peak_rss_since_start(GiB)"
LIVE_GROUPS = "fault_tolerance/live_groups"  # replica groups in this step's quorum (fault tolerance)
VALIDATION_LOSS = "validation_metrics/loss"
VALIDATION_PERPLEXITY = "validation_metrics/perplexity"

GIB = 1024**3

# -------------------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class Throughput:
    tokens_per_second: float  # per device
    tflops: float  # achieved model TFLOP/s per device
    mfu_percent: float | None  # None when the device peak is unknown


def compute_throughput(
    tokens: int, elapsed_seconds: float, flops_per_token: float, peak_flops: float | None
) -> Throughput:
    """Throughput of one device from the tokens it processed in ``elapsed_seconds``.

    ``flops_per_token`` counts forward + backward (about 6 x parameters + attention); MFU is achieved FLOP/s
    over the device's dense BF16 peak.
    """
    if elapsed_seconds <= 0:
        raise ValueError(f"elapsed_seconds must be positive, got {elapsed_seconds}")
    tokens_per_second = tokens / elapsed_seconds
    flops_per_second = tokens_per_second * flops_per_token
    mfu = None if not peak_flops else 100.0 * flops_per_second / peak_flops
    return Throughput(tokens_per_second, flops_per_second / 1e12, mfu)


def eta_seconds(steps_done: int, steps_left: int, elapsed_seconds: float) -> float:
    """Seconds for ``steps_left`` more steps at this process's average step time so far (``steps_done`` steps in
    ``elapsed_seconds``, the slow first, compiling steps included). After a resume or a heal the steps left are the
    run's target minus the step it is at, not minus the steps this process has done."""
    if steps_done <= 0:
        return math.inf
    return max(steps_left, 0) * elapsed_seconds / steps_done


@dataclass(frozen=True)
class Window:
    """What happened since the last log: wall time, time spent waiting on data, steps and local tokens."""

    elapsed_seconds: float
    data_seconds: float
    steps: int
    tokens: int


class StepTimer:
    """Times the log window (end to end and data loading) and the whole run, for throughput and ETA.

    Per step: ``with timer.data_loading(): batch = next(data_iter)``, train, ``timer.step_done(tokens)``;
    at a log step: ``timer.window_metrics(flops_per_token, peak_flops)`` (which starts a new window) and
    ``timer.eta_seconds(steps_left)``.

    On CUDA the times are host times: they are right over a window as long as the loop synchronises at
    least once per step (reading the loss does).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._run_start = clock()
        self._steps_total = 0
        self._new_window()

    def _new_window(self) -> None:
        self._window_start = self._clock()
        self._data_seconds = 0.0
        self._steps = 0
        self._tokens = 0

    @contextmanager
    def data_loading(self) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._data_seconds += self._clock() - start

    def step_done(self, tokens: int) -> None:
        """Count one optimizer step that processed ``tokens`` tokens on this rank."""
        self._steps += 1
        self._steps_total += 1
        self._tokens += tokens

    def take_window(self) -> Window:
        """The window since the last call, and start a new one."""
        window = Window(self._clock() - self._window_start, self._data_seconds, self._steps, self._tokens)
        self._new_window()
        return window

    def window_metrics(self, flops_per_token: float, peak_flops: float | None) -> dict[str, float]:
        """Throughput and time metrics of the window since the last call (then a new window starts)."""
        return window_metrics(self.take_window(), flops_per_token, peak_flops)

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside (validation, say) is left out of the current window's throughput; the ETA keeps
        it, as the remaining steps will have their share of it too."""
        start = self._clock()
        try:
            yield
        finally:
            self._window_start += self._clock() - start

    def eta_seconds(self, steps_left: int) -> float:
        return eta_seconds(self._steps_total, steps_left, self._clock() - self._run_start)


def window_metrics(window: Window, flops_per_token: float, peak_flops: float | None) -> dict[str, float]:
    """The throughput and time metrics of one log window, keyed by their TensorBoard tags."""
    throughput = compute_throughput(window.tokens, window.elapsed_seconds, flops_per_token, peak_flops)
    steps = max(window.steps, 1)
    metrics = {
        TOKENS_PER_SECOND: throughput.tokens_per_second,
        TFLOPS: throughput.tflops,
        END_TO_END_SECONDS: window.elapsed_seconds / steps,
        DATA_LOADING_SECONDS: window.data_seconds / steps,
        DATA_LOADING_PERCENT: 100.0 * window.data_seconds / window.elapsed_seconds,
    }
    if throughput.mfu_percent is not None:
        metrics[MFU] = throughput.mfu_percent
    return metrics


# ------------------------------------------------------------------------------------------ memory


def rss_bytes() -> int:
    """Current resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (since start, or since the last reset by ``MemoryMonitor``),
    from /proc (Linux), or None where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _reset_vm_hwm() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss_bytes() -> int:
    """Peak RSS since process start from getrusage (kilobytes on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class MemoryMonitor:
    """Peak memory per log window: call :meth:`reset_peak` when a window starts, :meth:`read` at its end.

    CUDA: peak active and reserved bytes of the caching allocator, in GiB and % of the device's capacity,
    plus allocation retries and OOMs (both cumulative since start: a rising retry count means fragmentation
    is slowing the run down before it fails).

    Other devices: the process's peak resident set size, which includes the Python runtime, libraries and
    allocator caches, not only tensors. It is reset per window through ``/proc/self/clear_refs`` where the
    kernel allows; where it does not, the value is the peak since process start and the key says so
    (``memory/peak_rss_since_start(GiB)``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.capacity_bytes = torch.cuda.get_device_properties(device).total_memory if self.is_cuda else 0
        self.window_resets = self.is_cuda or _reset_vm_hwm()

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.window_resets:
            self.window_resets = _reset_vm_hwm()

    def read(self) -> dict[str, float]:
        if self.is_cuda:
            return self._read_cuda()
        hwm = peak_rss_bytes() if self.window_resets else None
        if hwm is not None:
            return {PEAK_RSS_GIB: hwm / GIB}
        return {PEAK_RSS_SINCE_START_GIB: _ru_maxrss_bytes() / GIB}

    def _read_cuda(self) -> dict[str, float]:
        stats = torch.cuda.memory_stats(self.device)
        active = stats.get("active_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            CUDA_MAX_ACTIVE_GIB: active / GIB,
            CUDA_MAX_ACTIVE_PERCENT: 100.0 * active / self.capacity_bytes,
            CUDA_MAX_RESERVED_GIB: reserved / GIB,
            CUDA_MAX_RESERVED_PERCENT: 100.0 * reserved / self.capacity_bytes,
            CUDA_NUM_ALLOC_RETRIES: float(stats.get("num_alloc_retries", 0)),
            CUDA_NUM_OOMS: float(stats.get("num_ooms", 0)),
        }


# ------------------------------------------------------------------------------------ loss reduction


def global_avg_and_max(loss: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """(mean over ranks, max over ranks) of a scalar loss; the local value twice without a process group.

    The mean is the token mean when every rank saw the same number of tokens. Pass the data-parallel group
    when there is one; over the whole world the result is the same as long as ranks that share a batch
    (tensor / context parallel) hold the same loss, only with more traffic. DTensor losses are gathered
    with ``full_tensor()`` first.
    """
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    local = loss.detach().float().reshape(1)
    if not (dist.is_available() and dist.is_initialized()):
        value = local.item()
        return value, value
    total = local.clone()
    maximum = local.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    return total.item() / dist.get_world_size(group), maximum.item()


# ------------------------------------------------------------------------------------------- logger


def _short_count(n: float) -> str:
    """12,345 -> 12.3K; 4,200,000 -> 4.2M; 999,600 -> 1M (a source's tokens in the console line)."""
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        rounded = float(f"{n / limit:.3g}")  # 3 significant digits; 999,600 rounds to 1M, not 1000K
        if rounded >= 1:
            return f"{rounded:g}{suffix}"
    return f"{n:.0f}"


def _format_console_line(
    step: int, metrics: dict[str, float], total_steps: int | None, eta: float | None, mfu_note: str = ""
) -> str:
    """``step  10/100 | loss 5.1234 | grad_norm 1.23 | lr 3.00e-04 | ...`` with only the metrics present;
    ``mfu_note`` follows the MFU (a float8 run: which peak it is against)."""
    width = len(str(total_steps)) if total_steps else 0
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"]
    m = metrics
    if AVG_LOSS in m:
        parts.append(f"loss {m[AVG_LOSS]:.4f}")
    if LIVE_GROUPS in m:
        parts.append(f"groups {m[LIVE_GROUPS]:.0f}")
    if GRAD_NORM in m:
        parts.append(f"grad_norm {m[GRAD_NORM]:.3g}")
    if LR in m:
        parts.append(f"lr {m[LR]:.2e}")
    if TOKENS_PER_SECOND in m:
        parts.append(f"tps {m[TOKENS_PER_SECOND]:,.0f}")
    if TFLOPS in m:
        parts.append(f"tflops {m[TFLOPS]:.3g}")
    if MFU in m:
        parts.append(f"mfu {m[MFU]:.1f}%{mfu_note}")
    if CUDA_MAX_RESERVED_GIB in m:
        parts.append(f"mem {m[CUDA_MAX_RESERVED_GIB]:.2f}GiB ({m.get(CUDA_MAX_RESERVED_PERCENT, 0.0):.1f}%)")
    elif PEAK_RSS_GIB in m:
        parts.append(f"rss {m[PEAK_RSS_GIB]:.2f}GiB")
    elif PEAK_RSS_SINCE_START_GIB in m:
        parts.append(f"rss(max since start) {m[PEAK_RSS_SINCE_START_GIB]:.2f}GiB")
    if VALIDATION_LOSS in m:
        parts.append(f"validation loss {m[VALIDATION_LOSS]:.4f}")
    if VALIDATION_PERPLEXITY in m:
        parts.append(f"perplexity {m[VALIDATION_PERPLEXITY]:.2f}")
    held_out = [key[len(VALIDATION_SOURCES):-len("/loss")] for key in m
                if key.startswith(VALIDATION_SOURCES) and key.endswith("/loss") and key.count("/") == 2]
    if held_out:
        parts.append("by source " + " ".join(f"{name} {m[f'{VALIDATION_SOURCES}{name}/loss']:.4f}"
                                             for name in held_out))
    if DATA_LOADING_PERCENT in m:
        parts.append(f"data {m[DATA_LOADING_PERCENT]:.1f}%")
    sources = [key[len(DATA_SOURCES):-len("/tokens")] for key in m
               if key.startswith(DATA_SOURCES) and key.endswith("/tokens")]
    if sources:
        parts.append("sources " + " ".join(
            f"{name} {_short_count(m[f'{DATA_SOURCES}{name}/tokens'])}/{m.get(f'{DATA_SOURCES}{name}/epochs', 0):.2f}ep"
            for name in sources))
    if eta is not None and math.isfinite(eta):
        parts.append(f"eta {datetime.timedelta(seconds=round(eta))}")
    return " | ".join(parts)


TENSORBOARD_HINT = "pip install tensorboard, or pass --metrics.enable_tensorboard=false"


def check_metrics_packages(config: JobConfig) -> None:
    """The packages the ``[metrics]`` sinks need, checked without importing them, by the trainer right after the
    plan, before anything is built (a dry run or a precompile logs no metrics: it needs neither)."""
    if config.metrics.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"[metrics] enable_tensorboard = true needs the tensorboard package; {TENSORBOARD_HINT}.")
    if config.metrics.enable_wandb:
        from titan_simple.trainer.wandb_run import check_installed

        check_installed()


def _import_summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(
            f"[metrics] enable_tensorboard = true needs the tensorboard package; {TENSORBOARD_HINT}."
        ) from error
    return SummaryWriter


class MetricsLogger:
    """Writes each logged step to the console, ``<dump_folder>/metrics.jsonl`` (one JSON object per step,
    with ``"step"``), TensorBoard (``<dump_folder>/<save_tb_folder>/<run_name or timestamp>``) and, with ``wandb``
    options, a Weights & Biases run (``trainer/wandb_run.py``): the same keys and values at the same steps.

    Only ``rank == log_rank`` writes anything; on the other ranks every method is a no-op, so callers need
    no rank checks. The files and the W&B run are opened at the first :meth:`log`, not before: a run that fails
    before logging anything leaves none of them behind (the packages are imported here, so a broken install still
    fails at start-up). Files are flushed at every :meth:`log`, so a crash loses nothing already logged.
    Non-finite values are written to JSONL as ``NaN`` / ``Infinity`` (Python's json reads them back).
    """

    def __init__(
        self,
        dump_folder: str,
        *,
        rank: int,
        log_rank: int = 0,
        enable_tensorboard: bool,
        save_tb_folder: str = "tb",
        run_name: str | None = None,
        mfu_note: str = "",
        wandb: WandbOptions | None = None,
    ) -> None:
        self.enabled = rank == log_rank
        self.mfu_note = mfu_note
        self.dump_folder = dump_folder
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.tb_folder: str | None = None
        self._jsonl: IO[str] | None = None
        self._tb_writer: Any = None
        self._summary_writer: Any = None  # torch's SummaryWriter class, when TensorBoard is on
        self._wandb: WandbRun | None = None
        self._state = "new"  # "new" until the first log() opens the sinks, then "open", then "closed"
        if not self.enabled:
            return
        if enable_tensorboard:
            self._summary_writer = _import_summary_writer()
            # The start time names the folder, created at the first log.
            run_name = run_name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            self.tb_folder = os.path.join(dump_folder, save_tb_folder, run_name)
        if wandb is not None:
            from titan_simple.trainer.wandb_run import WandbRun  # wandb only when enabled

            self._wandb = WandbRun(dump_folder, wandb)

    def _open(self, step: int) -> None:
        """The sinks, at the first logged ``step``: the W&B run first (the one that can fail: a login, the
        network), then the files."""
        os.makedirs(self.dump_folder, exist_ok=True)
        if self._wandb is not None:
            self._wandb.open(first_step=step)
        self._jsonl = open(self.jsonl_path, "a")  # closed in close()
        if self._summary_writer is not None:
            self._tb_writer = self._summary_writer(log_dir=self.tb_folder)
        self._state = "open"

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        total_steps: int | None = None,
        eta_seconds: float | None = None,
    ) -> None:
        """Log ``metrics`` (keys = TensorBoard tags) at ``step``; ``total_steps`` and ``eta_seconds`` only
        decorate the console line."""
        if not self.enabled:
            return
        if self._state == "closed":
            raise RuntimeError("MetricsLogger.log() called after close()")
        values = {key: float(value) for key, value in metrics.items()}
        logger.info(_format_console_line(step, values, total_steps, eta_seconds, self.mfu_note))
        if self._state == "new":
            self._open(step)
        assert self._jsonl is not None
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if self._tb_writer is not None:
            for tag, value in values.items():
                self._tb_writer.add_scalar(tag, value, step)
            self._tb_writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, values)

    def close(self, failed: bool = False) -> None:
        """Close what :meth:`log` opened; ``failed`` marks the W&B run failed (the trainer says whether its loop
        ended on an exception)."""
        if self._wandb is not None:
            self._wandb.close(failed)
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self._state = "closed"

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(failed=exc_type is not None)
