"""Check a new node before training on it: what only this node's hardware and drivers can show, in about a minute.

    python scripts/gpu_check.py                      # every visible GPU (2 processes on a machine without one)
    python scripts/gpu_check.py --nproc 2 --keep     # 2 processes; keep the temporary folder (logs, traces)
    python scripts/gpu_check.py --only checkpoint,trace

It starts its own ``torchrun`` job on this node (the debug model, 2 layers, 32 tokens per sequence, built and
stepped by the trainer's own functions) and prints one table, one row per capability:

    process_group  NCCL with each rank bound to its GPU (torch.cuda.set_device + init_process_group's device_id,
                   as train.py does), or gloo on CPU, and an all-reduce whose sum is checked
    compile        SimpleFSDP compiled (bucketing transformer_block, reorder) against eager: the same losses and
                   gradient norms over 3 steps, within bf16 rounding on GPUs and 1e-5 in fp32 on CPU
    memory         the memory statistics the trainer logs (CUDA allocator peaks, or peak RSS on CPU)
    mfu            the MFU the trainer logs, from the peak table for the GPU it finds (none on CPU: skipped)
    async_tp       async tensor parallel (TP 2, symmetric memory, Inductor's fused kernels) against eager TP;
                   CUDA + NCCL with 2+ GPUs only, skipped elsewhere with the reason
    checkpoint     a DCP checkpoint saved in the background (async_mode async) and loaded back gives bitwise the
                   saved parameters and optimizer state
    trace          one profiled step writes a trace per rank that parses as JSON (with GPU kernels on CUDA)

Exit status: 0 when no row failed (skipped rows are fine), 1 when one did, 2 for a wrong option.

**How it runs.** The rows run in order in one job; each rank appends what happens (row started, row ended) to
``results/job-K/rankR.jsonl`` under the temporary folder, so a rank that dies still leaves what it finished. A row
that fails on any rank ends the job: its peers may be waiting in a collective that will never complete. The
script then names that row's reason in the table and starts a new job for the rows after it (a failed process
group ends the check: everything else needs it). The temporary folder is deleted at the end unless ``--keep`` is
given or a row failed; it holds each job's log (``job-K.log``).

**Only for tests:** ``GPU_CHECK_INJECT_FAILURE=memory`` makes rank 0 fail that row (a comma-separated list of
rows; ``row:crash`` makes rank 0 die during the row without reporting, as a segfault would), so a test can check
that a failure is reported, exits non-zero and the other rows still run. Nothing else reads it.

One GPU has run it (an H200 with torch 2.11, docs/gpu_runs.md): every row passed, the process group and async TP
skipped as one GPU must. Its multi-GPU paths were checked by reading torch 2.13's sources (named where they are
used) and its decisions are unit-tested with fake inputs (tests/test_gpu_check.py); its CPU run is tested.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from titan_simple.compile.compiler import transformer_block_plan  # noqa: E402
from titan_simple.config import JobConfig, load_job_config  # noqa: E402
from titan_simple.core.assemble import Run, build_run  # noqa: E402
from titan_simple.core.device_peaks import peak_flops_per_second  # noqa: E402
from titan_simple.core.optim import lr_scheduler_from_config  # noqa: E402
from titan_simple.core.plan import resolve_plan  # noqa: E402
from titan_simple.parallel.dims import tensor_parallel_mesh  # noqa: E402
from titan_simple.parallel.torch_private import probe_symmetric_memory  # noqa: E402
from titan_simple.trainer.checkpoint import CheckpointManager, TrainProgress  # noqa: E402
from titan_simple.trainer.distributed import (  # noqa: E402
    DistInfo,
    exit_process,
    init_process_group,
    read_launch_environment,
    shutdown_distributed,
)
from titan_simple.trainer.metrics import (  # noqa: E402
    CUDA_MAX_ACTIVE_GIB,
    CUDA_MAX_RESERVED_GIB,
    CUDA_MAX_RESERVED_PERCENT,
    CUDA_NUM_ALLOC_RETRIES,
    CUDA_NUM_OOMS,
    MFU,
    PEAK_RSS_GIB,
    PEAK_RSS_SINCE_START_GIB,
    TFLOPS,
    MemoryMonitor,
    StepTimer,
)
from titan_simple.trainer.profiling import Profiler  # noqa: E402

logger = logging.getLogger("gpu_check")

INJECT_VARIABLE = "GPU_CHECK_INJECT_FAILURE"  # tests only (module docstring)
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
STEPS = 3  # training steps of the compile and async-TP comparisons
# Losses and gradient norms of compiled against eager, relative, per step. fp32 on CPU: float reduction order only
# (tests/parity.py measures a few 1e-6 for losses; norms are sums of sharded squares). bf16 on GPUs: the eager
# kernels round every op's output to bf16 (unit roundoff 2^-8 = 0.4%), Inductor's fused kernels keep fp32 inside
# a fusion, so the two differ by a few roundings: 4 x 2^-8 = 1.6%. A real bug (a lost gradient bucket, a wrong
# scale) moves the gradient norm by far more.
FP32_LOSS_RTOL, FP32_NORM_RTOL = 1e-5, 1e-4
BF16_RTOL = 4 * 2.0**-8


# ---------------------------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Row:
    name: str  # for --only and GPU_CHECK_INJECT_FAILURE
    title: str  # the table's capability column
    todo: str  # what to do when the row fails with an unexpected error


@dataclass(frozen=True)
class Outcome:
    status: str  # PASS or SKIPPED (a failure is raised)
    detail: str  # the numbers that show it passed, or why it was skipped


class CheckFailed(Exception):
    """A row's own verdict that something is wrong: the reason and what to do, one line each."""

    def __init__(self, reason: str, todo: str) -> None:
        super().__init__(f"{reason}; {todo}")
        self.reason, self.todo = reason, todo


ROWS: tuple[Row, ...] = (
    Row("process_group", "process group + all-reduce",
        "check NCCL_SOCKET_IFNAME (the interface the ranks talk on, e.g. eth0 or ib0), NCCL_IB_HCA, that nvidia-smi "
        "lists every GPU, and rerun with NCCL_DEBUG=INFO for NCCL's own log"),
    Row("compile", "SimpleFSDP compiled vs eager",
        "train eagerly meanwhile (--compile.enable false) and report this table with the job log"),
    Row("memory", "memory statistics", "report this table with the job log: the trainer's memory metrics are wrong"),
    Row("mfu", "MFU", "report this table with the job log: the trainer's MFU is wrong"),
    Row("async_tp", "async tensor parallel",
        "set [parallelism] enable_async_tensor_parallel = false (the 405B config sets it) and report the job log"),
    Row("checkpoint", "DCP async save + load",
        "check that the dump folder's disk is writable and has space; --checkpoint.async_mode disabled meanwhile"),
    Row("trace", "profiler trace",
        "train without --profiling.enable_profiling meanwhile; on GPUs the profiler needs CUPTI (CUDA toolkit)"),
)
ROW_NAMES = tuple(row.name for row in ROWS)
ROWS_BY_NAME = {row.name: row for row in ROWS}


# ------------------------------------------------------------------------------- decisions (unit-tested)


def default_nproc(device_type: str, device_count: int) -> int:
    """Every visible GPU, or 2 CPU processes (the fewest that exercise collectives)."""
    return device_count if device_type == "cuda" else 2


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def loss_tolerances(device_type: str) -> tuple[float, float]:
    """(loss rtol, gradient-norm rtol) of compiled against eager: bf16 on GPUs, fp32 on CPU (see the constants)."""
    return (BF16_RTOL, BF16_RTOL) if device_type == "cuda" else (FP32_LOSS_RTOL, FP32_NORM_RTOL)


def precision_overrides(device_type: str) -> list[str]:
    """GPUs compute in bf16 as a GPU run does by default; CPU in fp32, pinned (``auto`` picks bf16 on CPUs with
    AVX512-BF16), so the comparison's tolerance is fp32's."""
    param = "bfloat16" if device_type == "cuda" else "float32"
    return [f"--training.mixed_precision_param={param}", "--training.mixed_precision_reduce=float32"]


def async_tp_skip_reason(device_type: str, backend: str, world_size: int) -> str | None:
    """Why async tensor parallel cannot be checked here, or None when it can: its fused kernels run on CUDA
    symmetric memory over NCCL, and TP 2 needs an even number of ranks."""
    if device_type != "cuda" or backend != "nccl":
        return (f"needs CUDA + NCCL (Inductor's fused kernels run on GPU symmetric memory); this run is on "
                f"{device_type} with {backend}: train.py refuses it there too")
    if world_size < 2 or world_size % 2:
        return f"needs an even number of GPUs for tensor parallel 2, not {world_size}; rerun with --nproc 2"
    return None


def fused_async_tp_ops(event_names: Iterable[str]) -> Counter:
    """The fused symmetric-memory ops in a profile's event names (``symm_mem::fused_all_gather_matmul``,
    ``symm_mem::fused_matmul_reduce_scatter``, ...): what Inductor's micro-pipelined TP pass puts in place of an
    all-gather + matmul or a matmul + reduce-scatter (torch 2.13, ``_inductor/fx_passes/micro_pipeline_tp.py``
    emits ``torch.ops.symm_mem.fused_*``, dispatcher ops the profiler records by name)."""
    return Counter(name for name in event_names if name.startswith("symm_mem::fused_"))


def compare_runs(device_type: str, runs: dict[str, list[tuple[float, float]]], what: str, reference: str) -> str:
    """The largest relative differences of ``what``'s (loss, grad norm) steps from ``reference``'s, as a detail line;
    raises ``CheckFailed`` beyond the tolerances of ``device_type``."""
    loss_rtol, norm_rtol = loss_tolerances(device_type)
    got, expected = runs[what], runs[reference]
    loss_diff = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, expected, strict=True))
    norm_diff = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, expected, strict=True))
    if loss_diff > loss_rtol or norm_diff > norm_rtol:
        raise CheckFailed(
            f"{what} differs from {reference} beyond rounding: losses by {loss_diff:.1e} (limit {loss_rtol:.0e}), "
            f"grad norms by {norm_diff:.1e} (limit {norm_rtol:.0e}); {what} {got}, {reference} {expected}",
            ROWS_BY_NAME["compile"].todo)
    return (f"{len(got)} steps: losses within {loss_diff:.1e} of {reference} (limit {loss_rtol:.0e}), grad norms "
            f"within {norm_diff:.1e} (limit {norm_rtol:.0e})")


def memory_outcome(device_type: str, metrics: dict[str, float]) -> Outcome:
    """The memory row from what ``MemoryMonitor.read()`` returned after a training step."""
    if device_type == "cuda":
        reserved, active = metrics.get(CUDA_MAX_RESERVED_GIB, 0.0), metrics.get(CUDA_MAX_ACTIVE_GIB, 0.0)
        if not 0 < active <= reserved:
            raise CheckFailed(f"CUDA allocator peaks make no sense: max active {active:.3f} GiB, max reserved "
                              f"{reserved:.3f} GiB", ROWS_BY_NAME["memory"].todo)
        return Outcome(PASS, f"max reserved {reserved:.2f} GiB ({metrics[CUDA_MAX_RESERVED_PERCENT]:.1f}% of the GPU), "
                             f"max active {active:.2f} GiB, {metrics[CUDA_NUM_ALLOC_RETRIES]:.0f} alloc retries, "
                             f"{metrics[CUDA_NUM_OOMS]:.0f} OOMs (torch.cuda.memory_stats, as the trainer logs)")
    key = PEAK_RSS_GIB if PEAK_RSS_GIB in metrics else PEAK_RSS_SINCE_START_GIB
    rss = metrics.get(key, 0.0)
    if not rss > 0:
        raise CheckFailed(f"the peak resident set size reads {rss} GiB", ROWS_BY_NAME["memory"].todo)
    return Outcome(PASS, f"{key} {rss:.2f} per rank (CPU: the process's peak resident set, as the trainer logs; no "
                         "allocator statistics off CUDA)")


def mfu_outcome(device_type: str, device_name: str, peak_flops: float | None, metrics: dict[str, float]) -> Outcome:
    """The MFU row from the window metrics the trainer would log (``StepTimer.window_metrics``)."""
    tflops = metrics[TFLOPS]
    if device_type != "cuda":
        return Outcome(SKIPPED, f"MFU is not defined on CPU: the peak table (PEAK_BF16_TFLOPS in core/device_peaks.py) "
                                f"lists GPUs only, so the trainer logs tflops ({tflops:.3g} here) and no mfu")
    if peak_flops is None:
        return Outcome(SKIPPED, f"'{device_name}' is not in the peak table, so the trainer logs no MFU; add its dense "
                                "BF16 TFLOP/s to PEAK_BF16_TFLOPS in titan_simple/core/device_peaks.py")
    mfu = metrics.get(MFU)
    if mfu is None or not 0 < mfu <= 100:
        raise CheckFailed(f"MFU {mfu} % is impossible ({tflops:.3g} TFLOP/s against {peak_flops / 1e12:.0f} peak)",
                          ROWS_BY_NAME["mfu"].todo)
    return Outcome(PASS, f"mfu {mfu:.2f}% of {device_name}'s {peak_flops / 1e12:.0f} TFLOP/s ({tflops:.3g} TFLOP/s: "
                         "a 2-layer debug model, so this checks the path, not the speed)")


def trace_problems(trace: dict, device_type: str, world_size: int) -> list[str]:
    """What a rank's Chrome trace lacks: the profiled step, a collective when there are peers, GPU kernels on CUDA
    (none means CUPTI recorded nothing: a driver or permission problem)."""
    events = trace.get("traceEvents", [])
    names = [str(e.get("name", "")) for e in events]
    problems = []
    if not any(n.startswith("ProfilerStep#") for n in names):
        problems.append("no ProfilerStep event")
    if world_size > 1 and not any(n.startswith(("gloo:", "nccl:", "c10d::", "_c10d_functional::")) for n in names):
        problems.append("no collective")
    if device_type == "cuda" and not any(e.get("cat") == "kernel" for e in events):
        problems.append("no GPU kernel: CUPTI recorded nothing (it may need NVreg_RestrictProfilingToAdminUsers=0 "
                        "or a matching CUDA toolkit)")
    return problems


def error_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip().rstrip(":")
    return text if len(text) <= 240 else text[:237] + "..."


def advice(row: Row, error: BaseException, device_type: str) -> str:
    """What to do about an unexpected error in ``row``: GPU memory, NCCL and gloo errors get their own advice."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        return "another process holds GPU memory: check nvidia-smi and free the GPUs"
    if "NCCL" in text or "nccl" in text:
        what = "NCCL init failed" if row.name == "process_group" else "NCCL failed"
        return f"{what}: {ROWS_BY_NAME['process_group'].todo}"
    if row.name == "process_group" and device_type != "cuda":
        return "check GLOO_SOCKET_IFNAME and that the loopback interface is up"
    return row.todo


def injected_failures(value: str | None) -> dict[str, str]:
    """``GPU_CHECK_INJECT_FAILURE`` (tests only): ``memory,checkpoint:crash`` -> {row: "raise" | "crash"}."""
    failures = {}
    for item in filter(None, (part.strip() for part in (value or "").split(","))):
        name, _, mode = item.partition(":")
        failures[name] = mode or "raise"
    return failures


# ----------------------------------------------------------------------------------------- the layouts


@dataclass
class Layout(Run):
    """One layout built as the trainer builds it (``core/assemble.build_run``), and the steps it has trained."""

    steps_done: int = 0


class Checks:
    """What the rows of one rank share: the launch environment, the folder, the layouts built so far.

    The layouts are built like ``tests/parity.py``'s ``build_layout`` (both call ``build_run``) rather than by it:
    that one is CPU and fp32 only by design (its device and recipe are constants), and a script users run should
    not depend on the test package, which is not part of what ``pip install`` ships."""

    def __init__(self, info: DistInfo, folder: Path) -> None:
        self.info = info
        self.device = info.device
        self.folder = folder
        self.layouts: dict[str, Layout] = {}
        self._meshes: dict[tuple, DeviceMesh | None] = {}

    @property
    def rank(self) -> int:
        return self.info.rank

    def ensure_process_group(self) -> None:
        """The process group as train.py starts it (``trainer/distributed.py``); nothing with one process."""
        if self.info.world_size > 1 and not dist.is_initialized():
            init_process_group(self.info, timeout_seconds=300)
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def config(self, *overrides: str) -> JobConfig:
        """The debug model, tiny: 2 layers, batches of 2 x 32 tokens per data-parallel rank."""
        return load_job_config([
            "--model.flavor=debugmodel", "--model.n_layers=2", "--training.seq_len=32",
            "--training.local_batch_size=2", "--optimizer.lr=1e-3", *precision_overrides(self.device.type),
            "--compile.bucketing=transformer_block", "--compile.reorder=true", "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={self.folder / 'run'}", *overrides,
        ])

    def build(self, name: str, *overrides: str) -> Layout:
        """Build (once) the layout ``name`` of ``config(*overrides)``. Layouts of equal degrees share one world mesh,
        as in the trainer: SimpleFSDP composes only slices of one root mesh."""
        if name in self.layouts:
            return self.layouts[name]
        config = self.config(*overrides)
        plan = resolve_plan(config, self.info.world_size, self.device.type)
        key = tuple(plan.dims.enabled_dims.items())
        if key not in self._meshes:
            self._meshes[key] = plan.dims.build_mesh(self.device.type)
        run = build_run(plan, self.device, mesh=self._meshes[key], lr_schedule=False)
        layout = Layout(**{f.name: getattr(run, f.name) for f in fields(Run)})
        self.layouts[name] = layout
        return layout

    def trained(self) -> Layout:
        """The compiled layout when the compile row built it, else an eager one (the rows after a failed compile)."""
        return self.layouts.get("compiled") or self.build("eager")


def data_parallel_group(layout: Layout) -> dist.ProcessGroup | None:
    names = [n for n in ("dp_replicate", "dp_shard") if n in layout.plan.dims.enabled_dims]
    if not names:
        return None
    return layout.mesh["dp" if len(names) == 2 else names[0]].get_group()


def global_batch(layout: Layout, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random token ids, the same on every rank and layout."""
    generator = torch.Generator().manual_seed(1234 + step)
    rows, seq_len = layout.plan.data.global_rows, layout.config.training.seq_len
    tokens = torch.randint(0, layout.plan.model_args.vocab_size, (rows, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(layout: Layout, steps: int, timer: StepTimer | None = None,
          after_step: Callable[[int], None] | None = None) -> list[tuple[float, float]]:
    """``steps`` more training steps; each one's (global mean loss, gradient norm). Each data-parallel rank takes
    its rows of the global batch; ``timer`` counts tokens per device as the trainer does."""
    group = data_parallel_group(layout)
    rows = layout.plan.data.global_rows // layout.dp_size
    mine = slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows)
    results = []
    for _ in range(steps):
        layout.steps_done += 1
        inputs, labels = global_batch(layout, layout.steps_done)
        result = layout.step([(inputs[mine], labels[mine])])
        loss_sum = result.loss_sum.detach().clone()
        if group is not None:
            dist.all_reduce(loss_sum, group=group)
        results.append((loss_sum.item() / result.global_tokens, result.grad_norm.item()))  # .item(): synchronizes
        if timer is not None:
            timer.step_done(result.global_tokens // max(dist.get_world_size() if dist.is_initialized() else 1, 1))
        if after_step is not None:
            after_step(layout.steps_done)
    return results


# ------------------------------------------------------------------------------------- the rows' checks


def check_process_group(checks: Checks) -> Outcome:
    """Start the process group as train.py does and all-reduce each rank's number; on CUDA also that the group is
    bound to this rank's GPU and that no two ranks share one.

    Checked by reading torch 2.13 (no GPU has run it): ``distributed_c10d.init_process_group(backend, init_method,
    timeout, world_size, rank, store, group_name, pg_options, device_id)`` takes ``device_id: torch.device | int``
    and, under NCCL, creates the communicator at once (``eager_connect_single_device``), so NCCL's errors surface
    here, not at the first collective; ``_new_process_group_helper`` sets ``pg.bound_device_id = device_id``."""
    info = checks.info
    if info.world_size == 1:
        checks.ensure_process_group()
        return Outcome(SKIPPED, "one process: train.py starts no process group then; rerun with --nproc 2 or more")
    checks.ensure_process_group()
    backend, expected_backend = dist.get_backend(), backend_for(checks.device.type)
    if backend != expected_backend:
        raise CheckFailed(f"the process group uses {backend}, not {expected_backend}",
                          ROWS_BY_NAME["process_group"].todo)
    where = ""
    if checks.device.type == "cuda":
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        if bound != checks.device:
            raise CheckFailed(f"rank {info.rank}: the process group is bound to {bound}, not {checks.device}",
                              "report this table: trainer/distributed.py no longer passes device_id")
        where = f"{torch.cuda.get_device_name(checks.device)} "
    value = torch.tensor([float(info.rank + 1)], device=checks.device)
    dist.all_reduce(value)
    expected = info.world_size * (info.world_size + 1) / 2
    if value.item() != expected:
        raise CheckFailed(f"all-reduce of 1 + ... + {info.world_size} gave {value.item()}, not {expected}",
                          ROWS_BY_NAME["process_group"].todo)
    placements: list = [None] * info.world_size
    dist.all_gather_object(placements, (socket.gethostname(), str(checks.device)))
    shared = [p for p, n in Counter(placements).items() if n > 1 and checks.device.type == "cuda"]
    if shared:
        raise CheckFailed(f"ranks share a GPU: {shared}", "check CUDA_VISIBLE_DEVICES: each local rank needs its own")
    devices = ", ".join(sorted({device for _, device in placements}))
    return Outcome(PASS, f"{backend}, {info.world_size} ranks on {where}{devices}: all-reduce of 1 + ... + "
                         f"{info.world_size} = {value.item():g} as expected")


def check_compile(checks: Checks) -> Outcome:
    """The eager and the compiled layout from the same seed, 3 steps of the same batches: the same losses and norms
    within rounding; the compiled forward gathers one bucket per transformer block (bucketing happened)."""
    runs = {"eager": train(checks.build("eager"), STEPS)}
    compiled = checks.build("compiled", "--compile.enable")
    started = time.perf_counter()
    runs["compiled"] = train(compiled, 1)
    compile_seconds = time.perf_counter() - started
    runs["compiled"] += train(compiled, STEPS - 1)
    detail = compare_runs(checks.device.type, runs, "compiled", "eager")
    return Outcome(PASS, f"{detail}; {bucket_summary(compiled)}; first compiled step {compile_seconds:.0f} s")


def bucket_summary(layout: Layout) -> str:
    """How many all-gathers the compiled forward issues against the buckets of the plan (one per transformer block,
    the embedding, the norm + output); more all-gathers than buckets means bucketing did not merge them."""
    if not layout.plan.dims.dp_enabled:
        return "one process: no FSDP collectives to bucket"
    recorders = layout.parts.comm_plan_recorders
    for recorder in recorders:
        recorder.restore()  # graphs loaded from torch's compile cache keep their plan there
    gathers = sum(r.counts("forward").get("all_gather", 0) for r in recorders)
    buckets = len(transformer_block_plan(layout.parts.modules[0]))
    if not any(r.graphs for r in recorders):
        return "comm plan not recorded (graphs from the compile cache)"
    if gathers > buckets:
        raise CheckFailed(f"the compiled forward issues {gathers} all-gathers for {buckets} buckets: bucketing did "
                          "not merge them", ROWS_BY_NAME["compile"].todo)
    return f"forward: {gathers} all-gathers for {buckets} buckets"


def check_memory(checks: Checks) -> Outcome:
    """One step between ``MemoryMonitor.reset_peak()`` and ``read()``, as the trainer's log window does.
    Checked by reading torch 2.13 ``torch/cuda/memory.py``: ``memory_stats`` flattens the allocator's nested stats to
    ``active_bytes.all.peak`` / ``reserved_bytes.all.peak`` / ``num_alloc_retries`` / ``num_ooms`` (the keys
    ``MemoryMonitor`` reads) and ``reset_peak_memory_stats(device)`` resets the peaks."""
    layout = checks.trained()
    monitor = MemoryMonitor(checks.device)
    monitor.reset_peak()
    train(layout, 1)
    return memory_outcome(checks.device.type, monitor.read())


def check_mfu(checks: Checks) -> Outcome:
    """Two timed steps through ``StepTimer.window_metrics`` with the peak the trainer would use."""
    layout = checks.trained()
    peak = peak_flops_per_second(checks.device)
    timer = StepTimer()
    train(layout, 2, timer=timer)
    metrics = timer.window_metrics(layout.parts.flops_per_token, peak)
    name = torch.cuda.get_device_name(checks.device) if checks.device.type == "cuda" else "cpu"
    return mfu_outcome(checks.device.type, name, peak, metrics)


def check_async_tp(checks: Checks) -> Outcome:
    """TP 2 (FSDP over the rest) with async TP, compiled, against eager TP 2: same losses within bf16 rounding, and
    the fused symmetric-memory ops in a profiled step. First a probe that symmetric memory works on the TP group."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    reason = async_tp_skip_reason(checks.device.type, backend, checks.info.world_size)
    if reason is not None:
        return Outcome(SKIPPED, reason)
    tensor_parallel = ["--parallelism.tensor_parallel_degree=2"]
    eager = checks.build("tp_eager", *tensor_parallel)
    problem = symmetric_memory_problem(tensor_parallel_mesh(eager.mesh).get_group(), checks.device)
    if problem is not None:
        return Outcome(SKIPPED, f"symmetric memory does not work on this node ({problem}): async TP cannot run here; "
                                "keep [parallelism] enable_async_tensor_parallel = false")
    runs = {"eager TP": train(eager, STEPS)}
    fused = checks.build("tp_async", *tensor_parallel, "--parallelism.enable_async_tensor_parallel",
                         "--compile.enable")
    runs["async TP"] = train(fused, STEPS - 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        runs["async TP"] += train(fused, 1)
    detail = compare_runs(checks.device.type, runs, "async TP", "eager TP")
    ops = fused_async_tp_ops(event.name for event in profile.events())
    if not ops:
        raise CheckFailed("the compiled TP step ran no fused symmetric-memory op: Inductor's async-TP pass fused "
                          "nothing", ROWS_BY_NAME["async_tp"].todo)
    return Outcome(PASS, f"{detail}; fused ops in one step: " + ", ".join(f"{n} x{c}" for n, c in sorted(ops.items())))


def symmetric_memory_problem(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """None when every rank of ``group`` could allocate and rendezvous a symmetric buffer, else the first error.
    The ranks agree on the outcome after each phase, so one rank's failure does not leave the others waiting in
    the rendezvous."""
    error = None
    try:
        probe_symmetric_memory(group, device)
    except Exception as e:  # noqa: BLE001 -- any failure means "not available", shared with the peers below
        error = error_line(e)
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed)
    if failed.item() == 0:
        return None
    return error or "another rank failed the probe"


def check_checkpoint(checks: Checks) -> Outcome:
    """Save a checkpoint in the background with the trainer's ``CheckpointManager`` (async_mode async), change the
    weights and optimizer state by training on while it writes, then load it: bitwise the saved state. Each rank
    compares its own shards (no gather)."""
    layout = checks.trained()
    if layout.steps_done == 0:  # Adam's state exists only after a step: save some to compare
        train(layout, 1)
    config = checks.config("--checkpoint.enable", "--checkpoint.async_mode=async", "--checkpoint.interval=1")
    manager = CheckpointManager(
        config, model_parts=layout.parts.modules, optimizer=layout.optimizer,
        lr_scheduler=lr_scheduler_from_config(config, layout.optimizer), dataloader=None,
        model_args=layout.parts.model_args, dp_rank=layout.dp_rank, dp_size=layout.dp_size, device=checks.device)
    saved = local_state(layout)
    started = time.perf_counter()
    manager.save(TrainProgress(global_step=layout.steps_done))  # not the last step: asynchronous
    staged = time.perf_counter() - started
    train(layout, 1)  # while the background thread writes: the staged copy must not change
    manager.close()
    if dist.is_initialized():  # rank 0 renames step-N.partial once its wait is over; the others return before that
        dist.barrier()
    written = time.perf_counter() - started
    changed = local_state(layout)
    if not any(not torch.equal(changed[k], v) for k, v in saved.items()):
        raise CheckFailed("a training step changed no parameter: the check cannot tell a load from nothing",
                          ROWS_BY_NAME["checkpoint"].todo)
    manager.load()
    loaded = local_state(layout)
    differing = sorted(k for k, v in saved.items() if k not in loaded or not torch.equal(loaded[k], v))
    if differing or loaded.keys() != saved.keys():
        raise CheckFailed(f"rank {checks.rank}: {len(differing)} of {len(saved)} tensors differ after the load "
                          f"({', '.join(differing[:3])}...)", ROWS_BY_NAME["checkpoint"].todo)
    optimizer_entries = sum(k.startswith("optimizer.") for k in saved)
    return Outcome(PASS, f"{len(saved) - optimizer_entries} parameters and {optimizer_entries} optimizer tensors "
                         f"bitwise equal after the load; staged in {staged:.2f} s, on disk after {written:.1f} s")


def local_state(layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer-state tensor, copied (the optimizer's step counts too)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    state = {}
    for name, param in layout.parts.as_module().named_parameters():
        state[f"param.{name}"] = local(param)
        for key, value in layout.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"optimizer.{name}.{key}"] = local(value)
    return state


def check_trace(checks: Checks) -> Outcome:
    """The trainer's ``Profiler`` over 3 steps (1 waited, 1 warm-up, 1 recorded); each rank reads its trace back."""
    layout = checks.trained()
    config = checks.config("--profiling.enable_profiling", "--profiling.profile_freq=3",
                           "--profiling.profiler_warmup=1", "--profiling.profiler_active=1")
    dump = Path(config.job.dump_folder)
    profiler = Profiler(config.profiling, str(dump), rank=checks.rank, device=checks.device)
    profiler.start(first_step=0)
    try:
        for step in range(1, 4):
            train(layout, 1)
            profiler.step(step)
    finally:
        profiler.stop()
    path = dump / config.profiling.save_traces_folder / "iteration_3" / f"rank{checks.rank}_trace.json"
    if not path.exists():
        raise CheckFailed(f"rank {checks.rank} wrote no {path}", ROWS_BY_NAME["trace"].todo)
    try:
        trace = json.loads(path.read_text())
    except ValueError as e:
        raise CheckFailed(f"{path} is not JSON ({error_line(e)})", ROWS_BY_NAME["trace"].todo) from None
    problems = trace_problems(trace, checks.device.type, checks.info.world_size)
    if problems:
        raise CheckFailed(f"{path.name} has {'; '.join(problems)}", ROWS_BY_NAME["trace"].todo)
    events = trace.get("traceEvents", [])
    kernels = sum(e.get("cat") == "kernel" for e in events)
    gpu = f", {kernels:,} GPU kernels" if checks.device.type == "cuda" else ""
    return Outcome(PASS, f"one trace per rank, e.g. {path.parent.name}/{path.name}: {path.stat().st_size / 2**20:.1f} "
                         f"MiB, {len(events):,} events{gpu}")


CHECKS: dict[str, Callable[[Checks], Outcome]] = {
    "process_group": check_process_group, "compile": check_compile, "memory": check_memory, "mfu": check_mfu,
    "async_tp": check_async_tp, "checkpoint": check_checkpoint, "trace": check_trace,
}


# ------------------------------------------------------------------------------------------- the worker


class ResultLog:
    """This rank's ``rankR.jsonl``: a line when a row starts and one when it ends, flushed and synced at once, so
    the parent knows where a rank that died was."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")  # open for the life of the worker: the process ends without closing it

    def write(self, **record: object) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def run_row(checks: Checks, row: Row, injected: dict[str, str]) -> tuple[str, str]:
    """(status, detail) of one row on this rank; a failure's detail is its reason and what to do."""
    try:
        if row.name != "process_group":
            checks.ensure_process_group()
        mode = injected.get(row.name) if checks.rank == 0 else None
        if mode == "crash":
            os._exit(1)  # as a segfault would: no record, no clean-up
        if mode is not None:
            raise CheckFailed(f"injected failure ({INJECT_VARIABLE}, for tests only)", "unset it")
        outcome = CHECKS[row.name](checks)
        return outcome.status, outcome.detail
    except CheckFailed as failure:
        return FAIL, f"{failure.reason}; {failure.todo}"
    except Exception as error:  # noqa: BLE001 -- any error is this row's failure, reported in the table
        logger.exception("row %s failed", row.name)
        return FAIL, f"{error_line(error)}; {advice(row, error, checks.device.type)}"


def worker(folder: Path, results: Path, rows: list[str]) -> None:
    """One rank: run ``rows`` in order, record each; after a failure leave at once (the parent starts the rest)."""
    info = read_launch_environment()
    logging.basicConfig(level=logging.INFO, format=f"[rank{info.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    log = ResultLog(results / f"rank{info.rank}.jsonl")
    checks = Checks(info, folder)
    injected = injected_failures(os.environ.get(INJECT_VARIABLE))
    for name in rows:
        log.write(row=name, event="start")
        started = time.perf_counter()
        status, detail = run_row(checks, ROWS_BY_NAME[name], injected)
        log.write(row=name, event="end", status=status, detail=detail, seconds=time.perf_counter() - started,
                  time=time.time())
        logger.info("%s: %s (%s)", name, status, detail)
        if status == FAIL:
            os._exit(1)  # peers may wait in a collective this rank will never join: torchrun stops them
    shutdown_distributed()
    exit_process(0)


# ------------------------------------------------------------------------------------------- the parent


@dataclass(frozen=True)
class RowResult:
    status: str
    seconds: float
    detail: str


@dataclass(frozen=True)
class JobEnd:
    """How one torchrun job ended, and what each rank recorded."""

    exit_code: int | None  # None: killed after the timeout
    records: dict[int, list[dict]]  # rank -> its records in order
    log: Path
    timeout_s: float


def read_records(results: Path, nproc: int) -> dict[int, list[dict]]:
    records: dict[int, list[dict]] = {}
    for rank in range(nproc):
        path = results / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[rank] = [json.loads(line) for line in lines if line.strip().endswith("}")]
    return records


# What a rank's collective says when a peer has gone: the peer's failure, not this rank's.
PEER_LEFT = ("Connection closed by peer", "Connection reset by peer")


def merge_job(rows: list[str], job: JobEnd, nproc: int) -> tuple[dict[str, RowResult], list[str]]:
    """The results of a job's rows up to the first that did not pass on every rank (that one included, as a
    failure), and the rows left for the next job. A row passes where every rank recorded its end without failure;
    its seconds and detail are rank 0's. Of several failing ranks the first to fail is named: the others often
    only saw it leave ("Connection reset by peer"). A rank that died in the row without a word is named before
    ranks whose only error is that a peer left."""
    ends = {rank: {r["row"]: r for r in recs if r["event"] == "end"} for rank, recs in job.records.items()}
    starts = {rank: {r["row"] for r in recs if r["event"] == "start"} for rank, recs in job.records.items()}
    results: dict[str, RowResult] = {}
    for index, name in enumerate(rows):
        mine = [ends.get(rank, {}).get(name) for rank in range(nproc)]
        failed = [(rank, end) for rank, end in enumerate(mine) if end is not None and end["status"] == FAIL]
        died = job.exit_code is not None and any(end is None and name in starts.get(rank, set())
                                                 for rank, end in enumerate(mine))
        causes = [(rank, end) for rank, end in failed if not any(text in end["detail"] for text in PEER_LEFT)]
        if causes or (failed and not died):
            rank, end = min(causes or failed, key=lambda item: (item[1].get("time", 0.0), item[0]))
            who = f"rank {rank}: " if nproc > 1 else ""
            results[name] = RowResult(FAIL, end["seconds"], who + end["detail"])
        elif all(end is not None for end in mine):
            results[name] = RowResult(mine[0]["status"], mine[0]["seconds"], mine[0]["detail"])
            continue
        else:
            results[name] = RowResult(FAIL, 0.0, unfinished_reason(name, mine, starts, job))
        return results, rows[index + 1:]
    return results, []


def unfinished_reason(name: str, ends: list[dict | None], starts: dict[int, set[str]], job: JobEnd) -> str:
    """Why a row has no result from some rank: a hang (timeout), a rank that died in it, or a job that ended before."""
    silent = [rank for rank, end in enumerate(ends) if end is None]
    hint = last_error_line(job.log)
    where = f"; log {job.log}" + (f" ('{hint}')" if hint else "")
    if job.exit_code is None:
        return (f"no result after {job.timeout_s:.0f} s (ranks {silent} hung, maybe in a collective); "
                f"{ROWS_BY_NAME['process_group'].todo}{where}")
    dead = [rank for rank in silent if name in starts.get(rank, set())]
    if dead:
        return f"rank {dead[0]} died during this row (job exit code {job.exit_code}){where}; {ROWS_BY_NAME[name].todo}"
    return f"the job ended (exit code {job.exit_code}) before this row started{where}"


def last_error_line(log: Path) -> str:
    """The last line of a job log that names an error or a signal, for the table (the log has the rest); torchrun's
    own summary of a failed rank ("ChildFailedError") and the SIGTERM it sends the other ranks say nothing the
    table does not."""
    if not log.exists():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    hits = [line for line in lines if ("Error" in line or "Signal " in line or "error:" in line)
            and not any(noise in line for noise in ("ChildFailedError", "elastic", "(SIGTERM)"))]
    return hits[-1][:160] if hits else ""


def launch_job(index: int, rows: list[str], nproc: int, folder: Path, timeout_s: float) -> JobEnd:
    """One ``torchrun --standalone`` job on this node running ``rows``; its output goes to ``job-<index>.log``."""
    results = folder / "results" / f"job-{index}"
    log = folder / f"job-{index}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", "--folder", str(folder), "--results", str(results), "--only", ",".join(rows)]
    with open(log, "w") as out:
        # A session of its own, so a hung job is stopped whole (torchrun and its ranks) and Ctrl-C here stops it.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_DIR,
                                   start_new_session=True)
        try:
            exit_code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return JobEnd(exit_code, read_records(results, nproc), log, timeout_s)


def run_rows(rows: list[str], nproc: int, folder: Path, timeout_s: float) -> dict[str, RowResult]:
    """Every row's result: jobs one after another, each starting after the row that ended the one before."""
    results: dict[str, RowResult] = {}
    remaining, job = list(rows), 0
    while remaining:
        job += 1
        finished, remaining = merge_job(remaining, launch_job(job, remaining, nproc, folder, timeout_s), nproc)
        results.update(finished)
        if finished.get("process_group", RowResult(PASS, 0, "")).status == FAIL:
            for name in remaining:
                results[name] = RowResult(SKIPPED, 0.0, "needs the process group (failed above)")
            break
    return results


def format_table(results: dict[str, RowResult]) -> str:
    """The table: capability | result | seconds | what to do / why, in row order."""
    header = ("capability", "result", "seconds", "what to do / why")
    lines = [(ROWS_BY_NAME[name].title, r.status, f"{r.seconds:.1f}", r.detail)
             for name, r in sorted(results.items(), key=lambda item: ROW_NAMES.index(item[0]))]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(3)]

    def join(cells: tuple[str, ...]) -> str:
        return " | ".join([cells[0].ljust(widths[0]), cells[1].ljust(widths[1]), cells[2].rjust(widths[2]), cells[3]])

    rule = "-+-".join(["-" * widths[0], "-" * widths[1], "-" * widths[2], "-" * len(header[3])])
    return "\n".join([join(header), rule, *map(join, lines)])


def parse_rows(value: str | None) -> list[str]:
    """``--only``'s rows in table order (all when not given); ValueError names an unknown one."""
    if not value:
        return list(ROW_NAMES)
    rows = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in rows if name not in ROWS_BY_NAME]
    if unknown:
        raise ValueError(f"--only {', '.join(unknown)}: no such check; choose from {', '.join(ROW_NAMES)}")
    return [name for name in ROW_NAMES if name in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (GPUs) to check; default: every visible GPU, or 2 without one")
    parser.add_argument("--only", default=None, help=f"comma-separated rows to run: {', '.join(ROW_NAMES)}")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, traces, checkpoint)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one job may take before it counts as hung (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the job
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows = parse_rows(args.only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        worker(Path(args.folder), Path(args.results), rows)
        return 0
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.cuda.device_count() if device_type == "cuda" else 0
    nproc = args.nproc or default_nproc(device_type, count)
    if nproc < 1 or (device_type == "cuda" and nproc > count):
        print(f"error: --nproc {nproc}: this node has {count} visible GPUs; give 1 to {count}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    where = f"{nproc} GPU{'s' * (nproc > 1)}" if device_type == "cuda" else f"{nproc} CPU process{'es' * (nproc > 1)}"
    print(f"gpu_check: {where} ({backend_for(device_type)}), torch {torch.__version__}, debug model with 2 layers; "
          f"{len(rows)} checks", flush=True)
    results = run_rows(rows, nproc, folder, args.timeout)
    print(format_table(results))
    failed = [name for name, r in results.items() if r.status == FAIL]
    if args.keep or failed:
        print(f"logs, traces and checkpoint kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    if failed:
        print(f"{len(failed)} check{'s' * (len(failed) > 1)} failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
