"""FSDP2 vs SimpleFSDP, eager and compiled, side by side: tokens/s, memory, collectives, compile time, MFU.

    .venv/bin/python scripts/benchmarks/benchmark.py --quick                 # smoke test: 1 repeat, few steps
    .venv/bin/python scripts/benchmarks/benchmark.py --doc --budget-minutes 23 \
        --configs fsdp2_eager,simple_tb_reorder,...
                                  # the full run; rewrites docs/benchmarks.md's table and benchmarks.png (the exact
                                  # command of the published table is in that doc)
    .venv/bin/python scripts/benchmarks/benchmark.py --workloads comm --world-sizes 2 \
        --configs fsdp2_eager,simple_tb_reorder
    .venv/bin/python scripts/benchmarks/benchmark.py --profile simple_tb_reorder --workloads compute --world-sizes 2

Every measurement is one fresh ``torchrun --standalone`` job running the real :class:`Trainer` (this file,
``--worker`` mode) with config overrides, so it measures what ``train.py`` runs. Repeats are interleaved: repeat
1 of every (workload, world size, configuration), then repeat 2, ... (the configuration order rotates), so a
slow spell on the shared machine hits every configuration alike rather than one. Each job writes one JSON
(every rank's figures); the driver reports medians.

Figures, per rank (every rank measures, the table shows the mean over ranks of the per-run figure, then the
median over repeats):

* **tokens/s**: local tokens / step time, the median over the measured steps (after ``--warmup`` steps, which
  include compilation). Step time = from the end of one training step to the end of the next, i.e. the whole
  loop iteration the trainer's own ``throughput(tps)`` covers (data loading, forward, backward, clipping,
  optimizer, the loss all-reduce).
* **peak RSS** (the one memory method for eager and compiled; CPU has no allocator statistics): the process's
  peak resident set size during a measured step (``/proc/self/clear_refs`` resets the kernel's high-water
  mark at the start of each step, ``MemoryMonitor`` reads it), median over measured steps. Like CUDA's
  *reserved* bytes it includes what the allocator keeps, plus the Python runtime, libraries and compiled code;
  **step delta** = that peak minus the RSS when the step starts, i.e. what one step adds on top of the state
  that lives across steps (weights, optimizer state, caches).
* **collectives / step**: all-gathers / reduce-scatters / all-reduces issued inside one training step: the
  ``c10d::`` ops torch.profiler records on one extra step after the measured ones (one method for eager and
  compiled; FSDP2's per-block all-gathers, SimpleFSDP's per-parameter or bucketed functional collectives and
  the gradient-norm all-reduce alike). For compiled SimpleFSDP the job also keeps the comm plan's counts
  (``comm_plan.json``, forward + backward), which must agree.
* **compile s**: time of the warm-up steps minus ``warmup x`` the median step, the least over repeats:
  Dynamo + AOTAutograd + Inductor (our bucketing / reordering pass included) plus other first-step costs
  (optimizer state: ~0 in eager rows). The C++ kernels are built once per invocation and shared through
  Inductor's cache (a cold build takes minutes per job on this 2-core machine and would mostly measure
  whichever job ran first); the least over repeats is the repeat that found them built.
* **MFU**: model FLOPs per second (``flops_per_token`` x tokens/s) over a matmul rate measured in the same
  job: every rank times a 1024^3 fp32 matmul on one thread at the same moment after training (best of a few),
  so at world size 4 on 2 cores each rank's peak is the share it really gets.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import harness

DOC = harness.DOCS / "benchmarks.md"
PLOT = harness.DOCS / "benchmarks.png"
BEGIN, END = "<!-- benchmark.py: begin -->", "<!-- benchmark.py: end -->"
MIB = 2**20

# ------------------------------------------------------------------------------------ the matrix


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    flavor: str
    seq_len: int
    local_batch_size: int
    extra: tuple[str, ...] = ()  # more trainer overrides for every configuration of this workload


WORKLOADS: dict[str, Workload] = {
    "compute": Workload("compute", "compute-heavy", "debugmodel_large", seq_len=512, local_batch_size=1),
    # Few tokens per rank against 27M parameters to gather and reduce every step: the collectives dominate,
    # as they do across nodes.
    "comm": Workload("comm", "communication-heavy", "debugmodel_large", seq_len=32, local_batch_size=1),
    # TorchTitan's llama3_debugmodel shape (dim 256, 6 layers, local batch 8 x 2048, selective AC), to set
    # beside TorchTitan 0.3.0's own SimpleFSDP run by ../shared/peer/run_peer.sh (docs/benchmarks.md,
    # "vs TorchTitan 0.3.0"). Our debugmodel has 8 KV heads to its 16: slightly less work per token.
    "peer": Workload("peer", "TorchTitan debugmodel shape", "debugmodel", seq_len=2048, local_batch_size=8,
                     extra=("--activation_checkpoint.mode=selective", "--training.mixed_precision_param=auto")),
    # The same tokens per step in shorter sequences: attention is a quarter of the peer shape's, so the rest of
    # the step (matmuls, collectives, loss) weighs more. The second shape of the comparison.
    "peer_seq512": Workload("peer_seq512", "TorchTitan debugmodel, seq 512", "debugmodel", seq_len=512,
                            local_batch_size=32,
                            extra=("--activation_checkpoint.mode=selective", "--training.mixed_precision_param=auto")),
    # Pipeline parallel with data parallel (4 ranks: pp2 x dp_shard2), 8 microbatches of 32 tokens against 27M
    # parameters: how often SimpleFSDP gathers decides the step ([parallelism] fsdp_gather).
    "comm_pp2": Workload("comm_pp2", "communication-heavy, pp2 x dp_shard2, 8 microbatches", "debugmodel_large",
                         seq_len=32, local_batch_size=8,
                         extra=("--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.data_parallel_shard_degree=2",
                                "--parallelism.pipeline_parallel_schedule=1F1B",
                                "--parallelism.pipeline_parallel_microbatch_size=1")),
    # For the end-to-end test only: the 6-layer debug model, a few tokens.
    "tiny": Workload("tiny", "smoke test", "debugmodel", seq_len=32, local_batch_size=1),
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    label: str
    overrides: tuple[str, ...]

    @property
    def compiled(self) -> bool:
        return "--compile.enable=true" in self.overrides

    @property
    def simple(self) -> bool:
        return "--parallelism.fsdp_implementation=simple" in self.overrides


def config_matrix() -> list[BenchConfig]:
    """FSDP2 eager / per-block compiled, SimpleFSDP eager, and SimpleFSDP compiled with every bucketing x
    reorder setting. ``auto`` appears once: its buckets are chosen for overlap, so it always reorders
    (``compile_model`` ignores ``reorder=false`` there with a warning); a second row would be the same run."""
    fsdp2 = ("--parallelism.fsdp_implementation=fsdp2",)
    simple = ("--parallelism.fsdp_implementation=simple",)
    on = ("--compile.enable=true",)
    configs = [
        BenchConfig("fsdp2_eager", "FSDP2 eager", (*fsdp2, "--compile.enable=false")),
        BenchConfig("fsdp2_compile", "FSDP2 + per-block compile", (*fsdp2, *on)),
        BenchConfig("simple_eager", "SimpleFSDP eager", (*simple, "--compile.enable=false")),
        # What a user gets from --compile.enable alone (the [compile] defaults).
        BenchConfig("simple_default", "SimpleFSDP compiled, defaults", (*simple, *on)),
    ]
    short = {"none": "none", "transformer_block": "tb", "auto": "auto"}
    for bucketing, reorder in itertools.product(("none", "transformer_block", "auto"), (False, True)):
        if bucketing == "auto" and not reorder:
            continue
        name = f"simple_{short[bucketing]}" + ("_reorder" if reorder else "")
        label = f"SimpleFSDP compiled, {bucketing}" + (" + reorder" if reorder else "")
        configs.append(BenchConfig(name, label, (*simple, *on, f"--compile.bucketing={bucketing}",
                                                 f"--compile.reorder={str(reorder).lower()}")))
    # Regional compilation: one compiled code for every block, bucketed and reordered inside it.
    configs.append(BenchConfig("simple_regional", "SimpleFSDP compiled regionally (2 blocks per region)",
                               (*simple, *on, "--compile.regional=true")))
    for blocks in (1, 4):
        configs.append(BenchConfig(f"simple_regional_{blocks}",
                                   f"SimpleFSDP compiled regionally ({blocks} block{'s' * (blocks > 1)} per region)",
                                   (*simple, *on, "--compile.regional=true", f"--compile.regional_blocks={blocks}")))
    return configs


def gather_configs() -> list[BenchConfig]:
    """SimpleFSDP gathering per microbatch vs once per step (``[parallelism] fsdp_gather``), eager and compiled:
    for the pipeline / accumulation workloads, so not part of ``all``; ``simple_eager`` / ``simple_default``
    are the ``auto`` choice."""
    simple = ("--parallelism.fsdp_implementation=simple",)
    per_mb, once = "--parallelism.fsdp_gather=per_microbatch", "--parallelism.fsdp_gather=once_per_step"
    return [
        BenchConfig("simple_eager_per_mb", "SimpleFSDP eager, gather per microbatch",
                    (*simple, "--compile.enable=false", per_mb)),
        BenchConfig("simple_eager_once", "SimpleFSDP eager, gather once per step",
                    (*simple, "--compile.enable=false", once)),
        BenchConfig("simple_default_per_mb", "SimpleFSDP compiled, gather per microbatch",
                    (*simple, "--compile.enable=true", per_mb)),
        BenchConfig("simple_default_once", "SimpleFSDP compiled, gather once per step",
                    (*simple, "--compile.enable=true", once)),
    ]


def float8_configs() -> list[BenchConfig]:
    """Float8 against the same job without it, SimpleFSDP compiled with the defaults: on CPU torchao
    emulates the float8 matmuls in fp32 after real casts, so these rows price the casts and the byte gathers, not
    float8's speed. Not part of ``all``."""
    base = ("--parallelism.fsdp_implementation=simple", "--compile.enable=true")
    return [
        BenchConfig("float8_off", "SimpleFSDP compiled, no float8", base),
        BenchConfig("float8", "float8 tensorwise, weights gathered in float8", (*base, "--model.converters=float8")),
        BenchConfig("float8_param_gather", "float8 tensorwise, weights gathered in the param dtype",
                    (*base, "--model.converters=float8", "--float8.all_gather=false")),
    ]


def memory_configs() -> list[BenchConfig]:
    """What activation checkpointing and the loss keep, with selective AC (the ``peer`` workload):
    the old default (every matmul output saved, the plain loss), TorchTitan's policy (every second matmul), and
    that with the chunked loss (today's default). Eager and compiled; not part of ``all``."""
    simple = ("--parallelism.fsdp_implementation=simple",)
    variants = (("all_matmuls_plain", "save every matmul, plain loss",
                 ("--activation_checkpoint.selective_ac_option=op_all_matmuls", "--training.loss_chunks=1")),
                ("op_plain", "every second matmul, plain loss",
                 ("--activation_checkpoint.selective_ac_option=op", "--training.loss_chunks=1")),
                ("op_chunked", "every second matmul, chunked loss",
                 ("--activation_checkpoint.selective_ac_option=op", "--training.loss_chunks=8")))
    return [BenchConfig(f"{mode}_{name}", f"SimpleFSDP {mode}, {label}",
                        (*simple, f"--compile.enable={str(mode == 'compiled').lower()}", *overrides))
            for mode in ("eager", "compiled") for name, label, overrides in variants]


@dataclasses.dataclass(frozen=True)
class Run:
    repeat: int
    workload: Workload
    world_size: int
    config: BenchConfig

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.workload.name, self.world_size, self.config.name)


def run_schedule(workloads: Sequence[Workload], world_sizes: Sequence[int], configs: Sequence[BenchConfig],
                 repeats: int, repeats_by_world_size: dict[int, int] | None = None) -> list[Run]:
    """Interleaved: every repeat visits every (configuration, world size, workload) once; the configuration
    order is rotated by the repeat index, so no configuration always runs first or last.
    ``repeats_by_world_size`` lowers (or raises) the count for some world sizes."""
    per_ws = {ws: (repeats_by_world_size or {}).get(ws, repeats) for ws in world_sizes}
    runs = []
    for r in range(max(per_ws.values())):
        shift = r % len(configs)
        # Configuration-major, in the order given: with --budget-minutes the configurations listed first are
        # measured at every world size and workload, the last ones are what the budget drops.
        for config in [*configs[shift:], *configs[:shift]]:
            for ws in world_sizes:
                if r >= per_ws[ws]:
                    continue
                for workload in workloads:
                    runs.append(Run(r, workload, ws, config))
    return runs


def trainer_overrides(workload: Workload, config: BenchConfig, steps: int, dump_folder: str) -> list[str]:
    return [
        "--config=llama3_debug.toml",
        f"--model.flavor={workload.flavor}",
        f"--training.seq_len={workload.seq_len}",
        f"--training.local_batch_size={workload.local_batch_size}",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=float32",
        "--training.global_batch_size=-1",
        "--lr_scheduler.warmup_steps=0",
        "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=1000000",
        f"--job.dump_folder={dump_folder}",
        *workload.extra,
        *config.overrides,
    ]


# ------------------------------------------------------------------------------------ the worker


def _collective_kind(name: str) -> str | None:
    """Functional (``all_gather_into_tensor``) and c10d (``_allgather_base_``) op names -> one kind.

    Profiler event names are strings, and most are c10d ops (``c10d::_allgather_base_``, ``c10d::allreduce_``)
    that are not in ``comm_plan.COLLECTIVE_KINDS`` (the functional ops of compiled graphs, keyed by op
    overload), so they are matched by substring here; the kinds are the comm plan's names."""
    name = name.lower()
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "gather" in name:
        return "all_gather"
    if "all_reduce" in name or "allreduce" in name:
        return "all_reduce"
    return None


def count_collectives(op_names: Iterable[str]) -> dict[str, int]:
    """{kind: count} over profiler event names: only the ``c10d::`` ops, one per collective (a functional
    collective records its own event and then its c10d op; gloo adds ``gloo:*`` events, and implements a
    reduce-scatter with an all-reduce, so neither is counted)."""
    counts: Counter[str] = Counter()
    for name in op_names:
        if name.startswith("c10d::") and (kind := _collective_kind(name)) is not None:
            counts[kind] += 1
    return dict(counts)


def matmul_flops_per_second(n: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` rate of an ``n x n`` fp32 matmul on one thread."""
    from titan_simple.parallel.speed_probes import matmul_flops, matmul_seconds, torch_threads

    with torch_threads(1):
        best = matmul_seconds(n, reps, least=True)
    return matmul_flops(n) / best


def step_probe(trainer: Any, count_last: bool, profile_step: int | None = None, profile_path: str | None = None,
               rank: int = 0):
    """A ``StepHooks`` for the trainer's step: times every step, reads the peak RSS of each, and counts the
    collectives of the last step (which is not timed); with ``profile_step`` (1-based) rank 0 writes a
    torch.profiler table of that step to ``profile_path`` instead."""
    import torch

    from titan_simple.core.step import StepHooks
    from titan_simple.trainer.metrics import PEAK_RSS_GIB, MemoryMonitor, rss_bytes

    class StepProbe(StepHooks):
        def __init__(self) -> None:
            self.memory = MemoryMonitor(trainer.device)
            self.count_last = count_last
            self.total = trainer.config.training.steps
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.peak_rss: list[int] = []
            self.start_rss: list[int] = []
            self.collectives: dict[str, int] = {}
            self._profiler: torch.profiler.profile | None = None

        def begin(self) -> None:
            index = len(self.starts)  # 0-based
            counting = self.count_last and index == self.total - 1
            if counting or (profile_step is not None and index == profile_step - 1):
                # The profiler, not a dispatch mode: compiled graphs run under it unchanged (a dispatch mode
                # makes Dynamo refuse them), and every collective, functional (compiled, SimpleFSDP eager) or
                # c10d (FSDP2), ends in exactly one ``c10d::`` op.
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._profiler.start()
            self.memory.reset_peak()
            self.start_rss.append(rss_bytes())
            self.starts.append(time.perf_counter())

        def end(self, result) -> None:
            result.local_mean.item()  # make sure the step is done (no-op on CPU, a sync on GPU)
            if self._profiler is not None:
                prof, self._profiler = self._profiler, None
                prof.stop()
                if profile_step is None:
                    self.collectives = count_collectives(e.name for e in prof.events())
                elif rank == 0:
                    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                    Path(profile_path).write_text(table)
                    prof.export_chrome_trace(str(Path(profile_path).with_suffix(".trace.json")))
            self.ends.append(time.perf_counter())
            peak = self.memory.read().get(PEAK_RSS_GIB)  # None when the kernel refuses resets
            self.peak_rss.append(int(peak * 2**30) if peak is not None else -1)

    return StepProbe()


def worker_main(argv: list[str]) -> None:
    """One rank of one measurement (started by torchrun): build the Trainer from config overrides, train
    ``warmup + steps (+1 counting step)`` steps, write this job's figures (rank 0, all ranks gathered)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--profile", default=None, help="write a torch.profiler table of one measured step here")
    args, overrides = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s")

    import torch
    import torch.distributed as dist

    from titan_simple.config import load_job_config
    from titan_simple.trainer.distributed import shutdown_distributed
    from titan_simple.trainer.trainer import Trainer

    config = load_job_config(overrides)
    t0 = time.perf_counter()
    trainer = Trainer(config)
    build_s = time.perf_counter() - t0
    probe = step_probe(trainer, count_last=args.profile is None,
                       profile_step=args.warmup + 1 if args.profile else None, profile_path=args.profile, rank=rank)
    trainer.run.step.hooks = probe
    trainer.train()

    if dist.is_initialized():
        dist.barrier()
    flops_rate = matmul_flops_per_second()
    steps = len(probe.ends)
    durations = [probe.ends[i] - probe.starts[i] for i in range(steps)]
    # A step's wall time: from the end of the previous step, so the loop around the step is included.
    walls = [probe.ends[i] - probe.ends[i - 1] for i in range(1, steps)]
    measured = list(range(args.warmup, steps - (1 if probe.count_last else 0)))
    training = config.training
    # This rank's share of the global batch: tensor- and pipeline-parallel ranks share their dp rank's tokens.
    dims = trainer.plan.dims
    local_tokens = training.local_batch_size * training.seq_len // (dims.tp * dims.pp)
    mine = {
        "rank": rank,
        "build_s": build_s,
        "step_durations_s": durations,
        "step_walls_s": [None, *walls],
        "measured_steps": measured,
        "local_tokens": local_tokens,
        "peak_rss_bytes": probe.peak_rss,
        "start_rss_bytes": probe.start_rss,
        "collectives_counted": probe.collectives,
        "matmul_flops_per_s": flops_rate,
        "flops_per_token": trainer.run.parts.flops_per_token,
        "num_params": trainer.run.parts.num_params,
    }
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        plan_path = Path(config.job.dump_folder) / "comm_plan.json"
        plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
        Path(args.result).write_text(json.dumps({
            "ranks": everyone,
            "comm_plan_counts": _plan_counts(plan) if plan else None,
            "dynamo_compile_times": torch._dynamo.utils.compile_times(repr="csv", aggregate=True),
            "torch": torch.__version__,
        }))
    shutdown_distributed()


def _plan_counts(plan: dict) -> dict[str, dict[str, int]]:
    return {graph: dict(Counter(c["kind"] for c in colls)) for graph, colls in plan["graphs"].items()}


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summarize_run(result: dict, config: BenchConfig) -> dict[str, Any]:
    """One job's figures: per rank first, then the mean over ranks."""
    per_rank = []
    for r in result["ranks"]:
        measured = r["measured_steps"]
        walls = [r["step_walls_s"][i] for i in measured if r["step_walls_s"][i] is not None]
        step_s = median(walls)
        warmup = [r["step_durations_s"][i] for i in range(min(measured, default=0))]
        tokens_per_s = median(r["local_tokens"] / w for w in walls)
        peaks = [r["peak_rss_bytes"][i] for i in measured if r["peak_rss_bytes"][i] >= 0]
        deltas = [r["peak_rss_bytes"][i] - r["start_rss_bytes"][i] for i in measured if r["peak_rss_bytes"][i] >= 0]
        per_rank.append({
            "tokens_per_s": tokens_per_s,
            "step_s": step_s,
            "compile_s": max(0.0, sum(warmup) - len(warmup) * median(r["step_durations_s"][i] for i in measured)),
            "peak_rss_mib": median(peaks) / MIB if peaks else float("nan"),
            "rss_delta_mib": median(deltas) / MIB if deltas else float("nan"),
            "mfu_percent": 100.0 * tokens_per_s * r["flops_per_token"] / r["matmul_flops_per_s"],
            "matmul_gflops": r["matmul_flops_per_s"] / 1e9,
        })
    summary = {k: statistics.fmean(p[k] for p in per_rank) for k in per_rank[0]}
    summary["collectives"] = collectives_per_step(result, config)
    return summary


def collectives_per_step(result: dict, config: BenchConfig) -> dict[str, int]:
    """{kind: count} of one step, as the profiler counted it on rank 0. Compiled SimpleFSDP: cross-checked
    against the comm plan's forward + backward collectives (a mismatch is printed, the profiler's count kept)."""
    counted = dict(result["ranks"][0]["collectives_counted"])
    plan = result.get("comm_plan_counts")
    if config.compiled and config.simple and plan:
        planned = Counter()
        for graph in ("forward", "backward"):
            planned.update(plan.get(graph, {}))
        for kind in ("all_gather", "reduce_scatter"):
            if planned.get(kind, 0) != counted.get(kind, 0):
                print(f"  note: {config.name}: {counted.get(kind, 0)} {kind} counted, {planned.get(kind, 0)} in the "
                      "comm plan", flush=True)
    return counted


def format_collectives(c: dict[str, int]) -> str:
    return "/".join(str(c.get(k, 0)) for k in ("all_gather", "reduce_scatter", "all_reduce"))


def aggregate(summaries: dict[tuple[str, int, str], list[dict[str, Any]]]) -> dict[tuple[str, int, str], dict]:
    """Median over repeats of every figure, except compile time: the least over repeats, i.e. the repeat that
    found the most C++ kernels already built by earlier jobs (the first compiled job of an invocation builds
    them all)."""
    out = {}
    for key, runs in summaries.items():
        agg = {k: median(r[k] for r in runs) for k in runs[0] if k != "collectives"}
        agg["compile_s"] = min(r["compile_s"] for r in runs)
        agg["collectives"] = runs[0]["collectives"]
        agg["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
        agg["repeats"] = len(runs)
        out[key] = agg
    return out


def results_table(results: dict[tuple[str, int, str], dict], configs: Sequence[BenchConfig]) -> str:
    """Markdown: one row per (workload, world size, configuration), speed-up against FSDP2 eager."""
    labels = {c.name: c.label for c in configs}
    lines = [
        "| workload | ranks | configuration | tokens/s per rank | vs FSDP2 eager | MFU % | peak RSS MiB "
        "| step delta MiB | collectives/step AG/RS/AR | compile s (least) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (workload, ws, name), r in results.items():
        base = results.get((workload, ws, "fsdp2_eager"))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {WORKLOADS[workload].description} | {ws} | {labels.get(name, name)} | {r['tokens_per_s']:,.0f} "
            f"| {ratio} | {r['mfu_percent']:.1f} | {r['peak_rss_mib']:,.0f} | {r['rss_delta_mib']:,.0f} "
            f"| {format_collectives(r['collectives'])} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def check_targets(results: dict[tuple[str, int, str], dict]) -> list[str]:
    """The compiled-SimpleFSDP targets at world size 2 (docs/benchmarks.md), each as one line with the numbers."""
    lines = []
    compiled = [n for n in {k[2] for k in results} if n.startswith("simple_") and n != "simple_eager"]

    def best(workload: str) -> tuple[str, dict] | None:
        rows = [(n, results[(workload, 2, n)]) for n in compiled if (workload, 2, n) in results]
        return max(rows, key=lambda x: x[1]["tokens_per_s"]) if rows else None

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    comm_best, comm_base = best("comm"), results.get(("comm", 2, "fsdp2_eager"))
    if comm_best and comm_base:
        x = comm_best[1]["tokens_per_s"] / comm_base["tokens_per_s"]
        lines.append(f"communication-heavy, 2 ranks: best SimpleFSDP compiled ({comm_best[0]}) = {x:.2f}x FSDP2 "
                     f"eager (target >= 1.5x): {verdict(x >= 1.5)}")
    comp_best, comp_base = best("compute"), results.get(("compute", 2, "fsdp2_eager"))
    comp_fsdp2c = results.get(("compute", 2, "fsdp2_compile"))
    if comp_best and comp_base:
        x = comp_best[1]["tokens_per_s"] / comp_base["tokens_per_s"]
        lines.append(f"compute-heavy, 2 ranks: best SimpleFSDP compiled ({comp_best[0]}) = {x:.2f}x FSDP2 eager "
                     f"(target >= 1.2x): {verdict(x >= 1.2)}")
    if comp_best and comp_fsdp2c:
        x = comp_best[1]["tokens_per_s"] / comp_fsdp2c["tokens_per_s"]
        lines.append(f"compute-heavy, 2 ranks: best SimpleFSDP compiled = {x:.2f}x FSDP2 per-block compile "
                     f"(target >= 1.0x): {verdict(x >= 1.0)}")
    for workload in ("comm", "compute"):
        b, base = best(workload), results.get((workload, 2, "fsdp2_eager"))
        if b and base:
            for key, what in (("peak_rss_mib", "peak RSS"), ("rss_delta_mib", "step delta")):
                d = b[1][key] - base[key]
                lines.append(f"{WORKLOADS[workload].description}, 2 ranks: {what} of {b[0]} {b[1][key]:,.0f} MiB vs "
                             f"FSDP2 eager {base[key]:,.0f} MiB ({d:+,.0f}; target <= FSDP2 eager): "
                             f"{verdict(d <= 0)}")
    return lines


def launch(run: Run, steps: int, warmup: int, out_dir: Path, profile: str | None = None,
           timeout_s: float = 900.0) -> dict | None:
    """One torchrun job; its JSON result, or None (the log's tail is printed) when it failed."""
    tag = f"r{run.repeat}_{run.workload.name}_ws{run.world_size}_{run.config.name}"
    job_dir = out_dir / "jobs" / tag
    job_dir.mkdir(parents=True, exist_ok=True)
    result_path = job_dir / "result.json"
    total_steps = warmup + steps + (0 if profile else 1)
    # One Inductor cache per benchmark invocation, so the C++ kernels (the bulk of a cold CPU compile: minutes on
    # this machine) are built once and shared by every job; the FX-graph and AOTAutograd caches are off, so every
    # compiled job still traces and lowers its graphs (what "compile s" reports).
    env = harness.benchmark_env(TORCHINDUCTOR_CACHE_DIR=str(out_dir / "inductor_cache"),
                                TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    job = harness.launch(
        Path(__file__).resolve(), "--worker", f"--result={result_path}", f"--warmup={warmup}",
        *([f"--profile={profile}"] if profile else []),
        *trainer_overrides(run.workload, run.config, total_steps, str(job_dir / "dump")),
        nproc=run.world_size, env=env, log=job_dir / "log.txt", timeout=timeout_s)
    if not job.ok or not result_path.exists():
        print(f"  FAILED ({job.returncode}) after {job.seconds:.0f} s: {tag}\n{job.tail()}", flush=True)
        return None
    result = json.loads(result_path.read_text())
    result["job_seconds"] = job.seconds
    return result


def plot(results: dict[tuple[str, int, str], dict], configs: Sequence[BenchConfig], path: Path) -> bool:
    """Bars of tokens/s per rank (top) and peak RSS (bottom), one column per (workload, world size)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): skipping the plot")
        return False
    panels = sorted({(w, ws) for w, ws, _ in results}, key=lambda p: (p[0] != "comm", p[1]))
    names = [c.name for c in configs if any(k[2] == c.name for k in results)]
    labels = {c.name: c.label for c in configs}
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 8.5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for col, (workload, ws) in enumerate(panels):
        for row, (key, ylabel) in enumerate((("tokens_per_s", "tokens/s per rank"), ("peak_rss_mib", "peak RSS MiB"))):
            ax = axes[row][col]
            values = [results.get((workload, ws, n), {}).get(key, 0.0) for n in names]
            ax.bar(range(len(names)), values, color=[colors[i % 10] for i in range(len(names))])
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([labels[n] for n in names], rotation=60, ha="right", fontsize=7)
            ax.set_ylabel(ylabel)
            if row == 0:
                ax.set_title(f"{WORKLOADS[workload].description}, {ws} ranks", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    python = sys.version.split()[0]
    return f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} (CPU, gloo), Python {python}"


def report(results, configs, args, argv: Sequence[str], elapsed_s: float) -> str:
    repeats = f"{args.repeats} interleaved repeat(s)" + (f" (world size=repeats: {args.world_size_repeats})"
                                                          if args.world_size_repeats else "")
    steps = f"{args.warmup} warm-up + {args.steps} measured steps per job, {repeats}"
    lines = [
        f"Measured by `python scripts/benchmarks/benchmark.py {' '.join(argv)}` in {elapsed_s / 60:.0f} min on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {machine_description()}; {steps}; OMP_NUM_THREADS=1 "
        "per rank.",
        "",
        "Workloads: " + "; ".join(
            f"{w.description} = `{w.flavor}`, local batch {w.local_batch_size} x seq {w.seq_len}"
            for w in WORKLOADS.values() if any(k[0] == w.name for k in results)
        ) + ".",
        "",
        results_table(results, configs),
        "",
        "Targets (world size 2):",
        "",
        *[f"- {line}" for line in check_targets(results)],
    ]
    return "\n".join(lines)


def driver_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 warm-up + 2 measured steps")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per job (default 6; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per job (default 2; quick 1)")
    parser.add_argument("--world-size-repeats", default="", metavar="WS=N,...",
                        help="repeats for some world sizes, e.g. 4=1 (default: --repeats for all)")
    parser.add_argument("--workloads", default="comm,compute", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--configs", default="all", help="comma list of configuration names, or all")
    parser.add_argument("--out", default=None, help="folder for the jobs' logs and results.json")
    parser.add_argument("--doc", action="store_true", help=f"rewrite the table in {DOC.relative_to(harness.REPO)} "
                        f"and {PLOT.relative_to(harness.REPO)}")
    parser.add_argument("--plot", default=None, help="write the plot here (default: with --doc, docs/)")
    parser.add_argument("--profile", default=None, metavar="CONFIG",
                        help="profile one measured step of CONFIG (first workload and world size) and print "
                             "the top ops, instead of benchmarking")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="launch no job that would likely end after this (its last duration, or the longest "
                             "so far, as the estimate); the report lists what was skipped")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    all_configs = config_matrix()
    known = [*all_configs, *gather_configs(), *memory_configs(), *float8_configs()]
    if args.list:
        for c in known:
            print(f"{c.name:<22s} {c.label:<42s} {' '.join(c.overrides)}")
        return
    by_name = {c.name: c for c in known}
    # In the order given: with --budget-minutes the first ones are the ones sure to run.
    configs = all_configs if args.configs == "all" else [by_name[n] for n in args.configs.split(",") if n in by_name]
    unknown = set(args.configs.split(",")) - set(by_name) - {"all"}
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; --list shows them")
    workloads = [WORKLOADS[w] for w in args.workloads.split(",")]
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="titan_simple_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.profile:
        config = by_name[args.profile]
        table = out_dir / "profile.txt"
        result = launch(Run(0, workloads[0], world_sizes[0], config), args.steps, args.warmup, out_dir,
                        profile=str(table))
        if result is not None:
            print(table.read_text())
            print(f"chrome trace: {table.with_suffix('.trace.json')}")
        return

    ws_repeats = {int(k): int(v) for k, v in (item.split("=") for item in args.world_size_repeats.split(",") if item)}
    runs = run_schedule(workloads, world_sizes, configs, args.repeats, ws_repeats)
    print(f"{len(runs)} jobs ({len(configs)} configurations x {len(workloads)} workloads x world sizes "
          f"{world_sizes}, repeats {args.repeats} {args.world_size_repeats}); logs in {out_dir}", flush=True)
    start = time.perf_counter()
    summaries: dict[tuple[str, int, str], list[dict]] = {}
    raw = []
    job_seconds: dict[tuple[str, int], float] = {}
    skipped: list[Run] = []
    failed: list[Run] = []
    for i, run in enumerate(runs):
        if args.budget_minutes is not None:
            # The last duration of this configuration at this world size, else at any (scaled by the world
            # size: the ranks share the cores), else the longest job so far.
            same = [(ws, t) for (name, ws), t in job_seconds.items() if name == run.config.name]
            expected = job_seconds.get((run.config.name, run.world_size)) or (
                max(t * run.world_size / ws for ws, t in same) if same else max(job_seconds.values(), default=0.0))
            if time.perf_counter() - start + expected > 60 * args.budget_minutes:
                skipped.append(run)
                continue
        result = launch(run, args.steps, args.warmup, out_dir)
        if result is None:
            failed.append(run)
            continue
        s = summarize_run(result, run.config)
        summaries.setdefault(run.key, []).append(s)
        job_seconds[(run.config.name, run.world_size)] = result["job_seconds"]
        raw.append({"repeat": run.repeat, "key": list(run.key), "summary": s, "job_seconds": result["job_seconds"]})
        print(f"[{i + 1}/{len(runs)} {time.perf_counter() - start:5.0f} s] r{run.repeat} {run.workload.name} "
              f"ws{run.world_size} {run.config.name:<20s} {s['tokens_per_s']:8,.0f} tok/s/rank  "
              f"peak {s['peak_rss_mib']:6,.0f} MiB  delta {s['rss_delta_mib']:5,.0f}  "
              f"coll {format_collectives(s['collectives'])}  compile {s['compile_s']:5.1f} s  "
              f"mfu {s['mfu_percent']:.1f}%  (job {result['job_seconds']:.0f} s)", flush=True)
        harness.save_json(out_dir / "results.json", raw)
    if not summaries:
        raise SystemExit("every job failed; see the logs above")
    order = {(w.name, ws, c.name): i for i, (w, ws, c) in
             enumerate(itertools.product(workloads, sorted(world_sizes), known))}
    results = dict(sorted(aggregate(summaries).items(), key=lambda kv: order[kv[0]]))
    text = report(results, configs, args, argv, time.perf_counter() - start)

    def describe(jobs: list[Run]) -> str:
        names = (f"repeat {r.repeat + 1} of {r.workload.name} ws{r.world_size} {r.config.name}" for r in jobs)
        return ", ".join(names) + "."

    if failed:
        text += f"\n\nFailed (logs in {args.out}/jobs; the table has the other repeats): " + describe(failed)
    if skipped:
        text += "\n\nNot run (over --budget-minutes): " + describe(skipped)
    print()
    print(text)
    (out_dir / "report.md").write_text(text + "\n")
    if args.doc:
        harness.write_block(DOC, BEGIN, END, text)
        print(f"wrote {DOC}")
    plot_path = Path(args.plot) if args.plot else (PLOT if args.doc else None)
    if plot_path is not None:
        plot(results, known, plot_path)


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        worker_main(argv[1:])
        from titan_simple.trainer.distributed import exit_process

        exit_process(0)  # no interpreter teardown after gloo (see exit_process)
    else:
        driver_main(argv)


if __name__ == "__main__":
    main()
