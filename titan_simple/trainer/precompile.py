"""Compile a job's graphs ahead, from one process: ``train.py --config ... --compile.precompile_world_size N``.

This process starts, one after another, a fresh process for each rank that compiles in the job (the leader of
each class of ranks with the same graphs: ``compile/once.py``; rank 0 alone under data parallel) on a fake
process group of ``N`` ranks (``fake_pg``: every collective returns at once), which builds that rank's run
exactly as the trainer does (``core/assemble.build_run``: the real model, materialized) and runs one training
step on random tokens of the job's shapes. The step compiles through the same compile-once path as the job's
leader, so it writes the same cache entries into ``[compile] cache_dir``; a job launched afterwards with the
same config on ``N`` ranks finds every graph there (its line after step 1 says "compiled 0"). Anything that
changes a graph (the config, the layout, torch, this package's code) misses the cache and compiles at run time,
as it would without precompiling.

It needs the memory of one rank of the job and the device kind the job runs on: on CUDA, one GPU of the same
kind (Inductor generates code for the device it compiles on). Written for CUDA as for CPU; only CPU has run it.
Not precompiled, each with one line: pipeline parallel (a stage's first step exchanges shapes with its
neighbours, which a fake process group cannot answer; the job compiles once per stage instead) and ``bucketing =
'auto'`` on CPU (its buckets come from collective timings measured on the live process group).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_simple.compile.cache import describe_recompile, use_compile_cache
from titan_simple.compile.once import CompileOnce, graph_class, use_session
from titan_simple.config import JobConfig
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import RunPlan, resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.parallel.fake_process_group import init_fake_process_group

logger = logging.getLogger(__name__)


def precompile_device(config: JobConfig) -> torch.device:
    """The device to compile for: ``[compile] precompile_device``, or this machine's (CUDA when present)."""
    wanted = config.compile.precompile_device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[compile] precompile_device = 'cuda' but this machine has no CUDA GPU: precompile on a "
                          "node with one GPU of the kind the job runs on (Inductor generates code for the device it "
                          "compiles on), or set precompile_device = 'cpu' for a CPU job.")
    return torch.device(wanted, 0) if wanted == "cuda" else torch.device("cpu")


def check_can_precompile(plan: RunPlan) -> None:
    """The one-line ConfigError of a plan this command cannot precompile, before anything is built."""
    from titan_simple.compile.inductor_private import compile_caches_forced_off

    compile_plan = plan.compile
    if not compile_plan.enabled or compile_plan.backend != "inductor":
        raise ConfigError("[compile] precompile_world_size needs [compile] enable = true with backend = 'inductor' "
                          "(there is nothing else to compile ahead).")
    if not compile_plan.once:
        raise ConfigError("[compile] precompile_world_size needs a job of 2 or more ranks with compile_on_one_rank "
                          "= true: the job's ranks load what the precompile wrote only when they compile once.")
    if plan.pipeline is not None:
        raise ConfigError("[compile] precompile_world_size: pipeline parallel is not precompiled (a stage's first "
                          "step exchanges shapes with its neighbours, which a fake process group cannot answer); "
                          "launch the job instead: it compiles once per stage.")
    if compile_plan.bucketing == "auto" and plan.device_type == "cpu":
        raise ConfigError("[compile] precompile_world_size with bucketing = 'auto' on CPU: its buckets come from "
                          "collective timings measured on the job's process group; use 'transformer_block' or let "
                          "the job compile.")
    if forced_off := compile_caches_forced_off():
        raise ConfigError(f"[compile] precompile_world_size: {' and '.join(forced_off)} keeps torch's compile caches "
                          "off, so nothing could be written for the job; unset it.")


def precompile(config: JobConfig) -> list[str]:
    """Compile ``config``'s graphs for ``[compile] precompile_world_size`` ranks into the compile cache; the lines
    it logged. Raises the one-line ConfigError of a config it cannot precompile, before anything is built."""
    device = precompile_device(config)
    with job_cpu_threads(config.compile.precompile_world_size, device) as threads:  # before the plan's fingerprint
        return _precompile(config, device, [threads] if threads else [])


def _precompile(config: JobConfig, device: torch.device, lines: list[str]) -> list[str]:
    world_size = config.compile.precompile_world_size
    plan = resolve_plan(config, world_size, device.type)
    check_can_precompile(plan)
    folder = use_compile_cache(plan.compile.cache_dir)  # one line if it cannot be written
    for line in lines:
        logger.info(line)
    why = describe_recompile(folder, plan.compile.fingerprint, plan.compile.fingerprint_parts, write=True)
    if why:
        lines.append(why)
        logger.info(why)
    # Every rank in a fresh process: DTensor caches sharding decisions per mesh value, so a second fake world in
    # one process would reuse the first one's meshes (dry_run/run.py).
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        leaders = pool.apply(_class_leaders, (config, device.type))
    for rank in leaders:
        start = time.perf_counter()
        with context.Pool(1) as pool:
            compiled, loaded, graphs = pool.apply(_compile_as, (config, rank, device.type))
        lines.append(f"precompile: rank {rank} of {world_size}: compiled {compiled} FX graphs, found {loaded} already "
                     f"in {folder} ({graphs} Dynamo graphs, {time.perf_counter() - start:.1f} s)")
        logger.info(lines[-1])
    threads = f" and OMP_NUM_THREADS={torch.get_num_threads()}" if device.type == "cpu" else ""
    lines.append(f"precompile: done; a job of {world_size} ranks with this config, [compile] cache_dir = {folder}"
                 f"{threads} loads these graphs")
    logger.info(lines[-1])
    return lines


@contextlib.contextmanager
def job_cpu_threads(world_size: int, device: torch.device) -> Iterator[str | None]:
    """Compile for the CPU threads each rank of a CPU job will run (Inductor keys CPU kernels by the count, so other
    counts would miss): ``OMP_NUM_THREADS`` where set (the job's launch from this shell inherits it), else 1 for a
    job of several ranks, as ``torchrun`` gives each of the workers it starts on a node. Set for this process and
    the ones it starts while the block runs (restored after); yields the line that says so (None on CUDA)."""
    if device.type != "cpu":
        yield None
        return
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = int(explicit) if explicit.isdigit() and int(explicit) > 0 else (1 if world_size > 1 else None)
    if threads is None:
        yield f"precompile: compiling for {torch.get_num_threads()} CPU threads per rank (torch's default here)"
        return
    why = ("OMP_NUM_THREADS" if explicit else "torchrun sets OMP_NUM_THREADS=1 when it starts several processes; "
           "to launch otherwise, set OMP_NUM_THREADS for the precompile and the job alike")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _environment(OMP_NUM_THREADS=str(threads)):
            yield f"precompile: compiling for {threads} CPU thread(s) per rank ({why})"
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _class_leaders(config: JobConfig, device_type: str) -> list[int]:
    """In a fresh process: every rank's class (``once.graph_class``) on a fake world; the lowest rank of each."""
    world_size = config.compile.precompile_world_size
    plan = resolve_plan(config, world_size, device_type)
    leaders: dict[Any, int] = {}
    for rank in range(world_size):
        init_fake_process_group(rank, world_size)
        try:
            leaders.setdefault(graph_class(plan.dims.build_mesh(device_type)), rank)
        finally:
            dist.destroy_process_group()
    return sorted(leaders.values())


def _compile_as(config: JobConfig, rank: int, device_type: str) -> tuple[int, int, int]:
    """In a fresh process: be ``rank`` of a fake world, build its run as the trainer does and run one step on
    random tokens. Returns the FX graphs compiled and found in the cache, and the Dynamo graphs."""
    world_size = config.compile.precompile_world_size
    device = precompile_device(config)
    plan = resolve_plan(config, world_size, device_type)
    folder = use_compile_cache(plan.compile.cache_dir)
    if config.training.deterministic:
        torch.use_deterministic_algorithms(True)  # part of the cache key, as in the job
    markers = Path(tempfile.mkdtemp(prefix="precompile-", dir=folder))
    session = CompileOnce(rank=rank, leader=rank, folder=markers, cache_folder=folder)
    init_fake_process_group(rank, world_size)
    try:
        mesh = plan.dims.build_mesh(device.type)
        with use_session(session):
            torch.manual_seed(config.training.seed)
            run = build_run(plan, device, mesh=mesh)
            run.step(_random_batches(plan, device))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(markers, ignore_errors=True)
    return (sum(r.compiled for r in session.records), sum(r.hits for r in session.records), len(session.records))


def _random_batches(plan: RunPlan, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's microbatches of random token ids, of the shapes and dtype the dataloader gives this rank."""
    training = plan.config.training
    shape = (training.local_batch_size, training.seq_len)
    vocab = plan.model_args.vocab_size
    return [(torch.randint(vocab, shape, device=device), torch.randint(vocab, shape, device=device))
            for _ in range(plan.accumulation_steps)]
