"""torch.compile for SimpleFSDP models, with Inductor's collective bucketing and reordering.

    compile_model(model, backend="inductor", bucketing="none", manual_plan=None, reorder=False,
                  dump_folder=None)

compiles ``model`` in place (``nn.Module.compile``), so the module tree and the state_dict names stay the same.
The Inductor settings go through ``torch.compile(..., options=...)`` and apply to this compile only. Our
post-grad pass (``post_grad_custom_post_pass``) runs on the forward and on the backward graph, and does:

* **bucketing** (SimpleFSDP paper, section 4):
  - ``"none"``: one all-gather / reduce-scatter per parameter, as traced;
  - ``"transformer_block"`` / manual: Inductor's ``manual_overlap_bucketing`` gets ``manual_plan`` (one entry
    per bucket, a module FQN or a list of FQNs; the default ``transformer_block_plan(model)`` is embeddings,
    each block, [norm, output]). It finds each module's nodes from their ``nn_module_stack`` /
    ``fwd_nn_module_stack`` metadata, so one plan serves both graphs. It merges the FSDP all-gathers and
    reduce-scatters of each bucket into one of each;
  - ``"auto"``: Inductor's overlap scheduler with ``collective_bucketing=True``, which greedily buckets the
    collectives its runtime model says can hide behind compute.
* **reordering** (``reorder``): in manual mode, block i+1's all-gather is issued before block i's compute
  (forward and backward prefetch), and block i's reduce-scatter wait moves past block i-1's. ``none`` +
  reorder runs the overlap scheduler without bucketing. ``auto`` always reorders (``reorder=False`` is ignored
  there, with a warning). The chosen order is pinned with Inductor's ``control_deps``
  (``insert_overlap_deps``, plus ``comm_plan.overlap_order`` in manual mode), because Inductor's own
  scheduler would otherwise move each all-gather back next to its wait, or a wait before the compute meant to
  hide it.
* **comm plan**: the final graph's collectives, recorded and written to ``dump_folder`` (``comm_plan.py``).

**Regional compilation** (``CompilePlan.compile_regional``, ``[compile] regional``) compiles regions of
``regional_blocks`` consecutive transformer blocks (``regions.py``; the last region also runs the final norm
and output projection, the embedding is a small region of its own) instead of the model: one options dict (one
pass object) for all of them, so Dynamo reuses a region's graphs for every other region of its shape and
compile time hardly grows with depth. The pass buckets each region (``region_bucket_plan``) and reorders inside
it, as in the whole-model graph; each region gathers the next region's first weights while its last block
computes (the hand-off), so that what a compiled graph cannot overlap with anything outside it stays small.
Compiling a repeated block once *inside* the whole graph is what torch's ``nested_compile_region`` is for, but
it fails on SimpleFSDP's DTensor gathers in torch 2.13 (``docs/research/repro/repro_nested_compile_region.py``;
docs/benchmarks.md, "Compile time against depth").

The other modules: ``comm_plan.py`` reads the graphs, ``cpu_cost_model.py`` gives the scheduler runtime
estimates on CPU (it swaps two functions of ``torch.utils._runtime_estimation`` while our pass runs, then
restores them), ``inductor_private.py`` holds every private torch API used here, ``compile_plan.py`` holds
``CompilePlan`` (what ``[compile]`` means for a run; no Inductor import) and ``once.py`` compiles each graph on
one rank for the others to load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from titan_simple.compile.cache import comm_plan_store, disable_compile_caches
from titan_simple.compile.comm_plan import (
    COLLECTIVE_KINDS,
    CommPlanRecorder,
    overlap_order,
    read_stored_plan,
    sink_last_reduce_scatter_waits,
)
from titan_simple.compile.cpu_cost_model import CpuRuntimeEstimator, cpu_roofline
from titan_simple.compile.inductor_private import (
    CustomGraphPass,
    add_control_deps,
    analytical_runtime_ms,
    manual_bucketing_only,
    manual_overlap_bucketing,
    prepare_compile,
    rank_local_compile_options,
    schedule_overlap_rank_local,
)
from titan_simple.compile.once import CompileOnce
from titan_simple.parallel.context_parallel import context_parallel_group_names
from titan_simple.parallel.simple_fsdp import data_parallel_group_names

logger = logging.getLogger(__name__)

BUCKETING_MODES = ("none", "transformer_block", "auto")
# The modules whose code decides what the post-grad pass does to a graph (part of its cache key).
_PASS_SOURCES = (*(Path(__file__).with_name(name) for name in ("compiler.py", "comm_plan.py", "cpu_cost_model.py")),
                 Path(__file__).with_name("inductor_private.py"))


def transformer_block_plan(model: nn.Module) -> list[str | list[str]]:
    """One bucket per transformer block, the embedding alone, and the remaining parameter-owning top-level
    modules (final norm + output projection) together: ``["tok_embeddings", "layers.0", ..., ["norm",
    "output"]]``."""
    layers = getattr(model, "layers", None)
    blocks = [f"layers.{name}" for name, _ in layers.named_children()] if isinstance(layers, nn.Module) else []
    before, after = [], []
    for name, child in model.named_children():
        if child is layers or not any(True for _ in child.parameters()):
            continue
        (after if blocks and name in ("norm", "output") else before).append(name)
    plan: list[str | list[str]] = [*before, *blocks]
    if after:
        plan.append(after if len(after) > 1 else after[0])
    return plan


# ------------------------------------------------------------------------------------------- the pass


class _OverlapPass(CustomGraphPass):
    """Our post-grad pass: bucket / reorder the collectives, then record them. ``uuid()`` makes the graphs it
    shapes cacheable (Inductor's FX graph cache, and so AOTAutograd's): on a cache hit the pass does not run,
    and the comm plan comes from the compile cache's copy (``compile/cache.py``), which is kept under the run's
    compile fingerprint. The fingerprint is a part of the uuid, so that a graph is reused exactly when its plan's
    copy was kept under the same name: a run whose fingerprint changed but whose graphs did not (this package's
    source edited elsewhere, a setting the graphs ignore) compiles again rather than load graphs without a plan."""

    def __init__(self, bucketing: str, plan, reorder: bool, cpu: bool, estimator, recorder: CommPlanRecorder,
                 sink_groups: frozenset[str] = frozenset(), fingerprint: str = ""):
        self.bucketing, self.plan, self.reorder, self.cpu = bucketing, plan, reorder, cpu
        self.estimator, self.recorder = estimator, recorder
        self.sink_groups = sink_groups  # regional: whose last reduction's wait sinks (sink_last_reduce_scatter_waits)
        self.fingerprint = fingerprint

    def uuid(self) -> str:
        """What decides the pass's output besides the graph: its settings, the source of every module that
        shapes it, the torch version, and the run's compile fingerprint (which names the comm plan's copy). The
        calibrated CPU runtime model of ``auto`` bucketing changes every run and only moves bucket boundaries (any
        bucketing computes the same values): only whether there is one enters the key."""
        settings = {"bucketing": self.bucketing, "plan": self.plan, "reorder": self.reorder, "cpu": self.cpu,
                    "sink_groups": sorted(self.sink_groups),
                    "estimator": self.estimator is not None, "torch": torch.__version__,
                    "run": self.fingerprint}
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
        for path in _PASS_SOURCES:
            digest.update(path.read_bytes())
        return digest.hexdigest()

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        has_collectives = any(n.op == "call_function" and n.target in COLLECTIVE_KINDS for n in graph.nodes)
        rates = self.estimator if isinstance(self.estimator, CpuRuntimeEstimator) else None
        with cpu_roofline(rates) if self.cpu else contextlib.nullcontext():
            self._bucket_and_reorder(gm, has_collectives)
        self.recorder.add(graph)

    def _bucket_and_reorder(self, gm: fx.GraphModule, has_collectives: bool) -> None:
        if has_collectives and self.plan is not None:
            if self.reorder:
                # insert_overlap_deps: pin the order we chose with control_deps. Without them Inductor's own
                # scheduler (peak-memory reordering) sinks every all-gather back next to its wait, and the
                # generated code overlaps nothing (measured: 0 compute kernels between any start and wait).
                manual_overlap_bucketing(gm, self.plan, insert_overlap_deps=True)
                # Its deps pin "the next collective starts before this wait", not "this collective overlaps
                # the compute between its start and its wait": in a transformer block's graph (regional)
                # Inductor then waited for both all-gathers before the attention compute, and fused the two
                # norms' weight gradients, which delayed the feed-forward reduce-scatter to the block's end
                # (measured). Pin that too; in a region's graph, after letting its last gradient reduction's wait
                # sink to the graph's end (the manual overlap leaves it where it was issued: nothing after it to
                # defer it past).
                if self.sink_groups:
                    sink_last_reduce_scatter_waits(gm.graph, set(self.sink_groups))
                add_control_deps(gm.graph, overlap_order(gm.graph))
                gm.recompile()
            else:
                manual_bucketing_only(gm, self.plan)
                gm.recompile()
        elif has_collectives and (self.bucketing == "auto" or self.reorder):
            auto = self.bucketing == "auto"
            # With tensor parallel the graph also holds TP's activation collectives, whose gathered outputs
            # are saved for backward; Inductor's bucketer asserts a single user and fails on them ("Expected
            # single user for all_gather_into_tensor", torch 2.13). Bucket only the process groups that carry
            # FSDP all-gathers (of parameters), i.e. the data-parallel ones.
            groups = {
                n.args[-1] for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_KINDS
            }
            # Estimates every rank computes alike (``runtime_estimator``), analytical compute estimates, and no
            # cross-rank alignment: Inductor's default benchmarks compute nodes and gathers the results over the
            # world group in every compile, which deadlocks pipeline stages (they compile one after another) and
            # ranks where one loaded the graph from the compile cache (inductor_private: schedule_overlap_rank_local).
            schedule_overlap_rank_local(
                gm,
                collective_bucketing=auto,
                pre_bucketing_fsdp_collectives=False,
                insert_overlap_deps=True,  # as for manual: keep the overlap in the generated code
                bucket_only_internode_comms=len(groups) > 1,
                custom_runtime_estimation=self.estimator,
                compute_estimator="analytical",
                collective_estimator="analytical",
            )
            gm.recompile()


_CALIBRATED: CpuRuntimeEstimator | None = None
RuntimeEstimator = Callable[[fx.Node, int | None], float | None]


def runtime_estimator(cpu: bool) -> RuntimeEstimator:
    """The overlap scheduler's runtime model, the same on every rank, so that every rank schedules its graph alike
    without exchanging estimates while compiling. CPU: ``CpuRuntimeEstimator``, calibrated once per process when
    the model is built (every rank together, with collectives: before any lazy compile). GPU: Inductor's own
    analytical model without NCCL's simulator (``analytical_runtime_ms``)."""
    if not cpu:
        return analytical_runtime_ms
    global _CALIBRATED
    if _CALIBRATED is None:  # once per process: every rank calibrates together (collectives)
        _CALIBRATED = CpuRuntimeEstimator.calibrate()
        logger.info(
            "compile: CPU runtime model: collective %.3f ms + bytes / %.1f MB/s, matmul %.1f GFLOP/s",
            _CALIBRATED.latency_ms, _CALIBRATED.bytes_per_ms / 1e3, _CALIBRATED.flops_per_ms / 1e6,
        )
    return _CALIBRATED


def gpu_scheduling_options(cpu: bool, bucketing: str) -> dict[str, bool]:
    """Inductor settings for CUDA, as TorchTitan's SimpleFSDP backend sets them (torchtitan graph_trainer
    jit_backend.py, pull request 1464): its own peak-memory reorder off, so the order our pass chose (collectives
    started early, waits late) is kept; and with bucketing, no buffer reuse, so a bucket's buffer is not handed to
    other kernels while its collective may still run. Only read against TorchTitan and torch 2.13, not yet run
    on a GPU. CPU keeps Inductor's defaults, which every CPU measurement in docs/ used."""
    if cpu:
        return {}
    return {"reorder_for_peak_memory": False, **({"allow_buffer_reuse": False} if bucketing != "none" else {})}


def _bucket_plan(model: nn.Module, bucketing: str, manual_plan: Sequence[str | Sequence[str]] | None,
                 plan_root: str, *, regional: bool) -> list[str | list[str]] | None:
    """The buckets the pass groups collectives into: the manual plan, or one per transformer block (plus the
    rest), prefixed with ``plan_root``; None without bucketing or for ``auto`` (which chooses its own)."""
    if bucketing == "auto" and manual_plan:
        raise ValueError("compile_model: a manual_plan needs bucketing 'transformer_block' (manual), not 'auto'.")
    plan = [list(p) if not isinstance(p, str) else p for p in manual_plan] if manual_plan else None
    if regional and bucketing == "transformer_block" and plan is None:
        raise ValueError("compile_model: regional compilation (modules=...) needs its bucket plan (manual_plan).")
    if bucketing == "transformer_block" and plan is None:
        plan = transformer_block_plan(model.get_submodule(plan_root))
    if plan is not None and plan_root:
        plan = [f"{plan_root}.{p}" if isinstance(p, str) else [f"{plan_root}.{q}" for q in p] for p in plan]
    return None if bucketing == "none" else plan


def compile_model(
    model: nn.Module,
    *,
    backend: str = "inductor",
    bucketing: str = "none",
    manual_plan: Sequence[str | Sequence[str]] | None = None,
    reorder: bool = False,
    dump_folder: str | None = None,
    fullgraph: bool = True,
    plan_root: str = "",
    extra_options: dict[str, Any] | None = None,
    fingerprint: str = "",
    modules: Sequence[nn.Module] | None = None,
    session: CompileOnce | None = None,
) -> CommPlanRecorder | None:
    """Compile ``model`` in place with the given collective bucketing / reordering; return the comm-plan
    recorder (``None`` for backends that run no Inductor pass): the build keeps it (``ModelParts``).

    ``bucketing``: ``none`` | ``transformer_block`` | ``auto``; ``manual_plan`` overrides the blocks' plan (one
    entry per bucket: an FQN or a list of them), ``plan_root`` prefixes it when ``model`` wraps the model.
    ``dump_folder``: where rank 0 writes ``comm_plan.json`` / ``.txt``. ``extra_options``: more Inductor settings
    (``CompilePlan.inductor_options``). ``fingerprint`` names the graphs for the comm plan's copy in the compile
    cache (``compile/cache.py``). ``modules``: compile these (the regions of ``regions.py``) instead of ``model``;
    ``manual_plan`` then names modules inside a region, and each graph's last gradient reduction waits at its
    end. ``session``: compile through this compile-once session (one rank compiles, the others load; ``once.py``).
    Every rank calls it (the CPU estimator calibrates with collectives)."""
    if bucketing not in BUCKETING_MODES:
        raise ValueError(f"compile_model: bucketing must be one of {BUCKETING_MODES}, got {bucketing!r}.")
    prepare_compile()
    if backend != "inductor":
        if bucketing != "none" or reorder or manual_plan:
            warnings.warn(f"compile backend {backend!r} runs no Inductor passes: bucketing/reorder ignored.",
                          stacklevel=2)
        for module in modules or [model]:
            module.compile(backend=backend, fullgraph=fullgraph)
        return None
    if bucketing == "auto" and not reorder:
        warnings.warn("compile: bucketing='auto' always reorders (its buckets are chosen for overlap).", stacklevel=2)
    plan = _bucket_plan(model, bucketing, manual_plan, plan_root, regional=modules is not None)
    modules = [model] if modules is None else modules
    cpu = not torch.cuda.is_available()
    estimator = runtime_estimator(cpu) if bucketing == "auto" or (bucketing == "none" and reorder) else None
    labels = dict.fromkeys(context_parallel_group_names(model), "cp")  # the comm plan names CP's collectives
    recorder = CommPlanRecorder(dump_folder, {"bucketing": bucketing, "reorder": reorder, "plan": plan},
                                group_labels=labels)
    # Regional compilation (modules=...): a region's last gradient reduction can wait at its graph's end.
    sink_groups = frozenset(data_parallel_group_names(model)) if modules is not None and reorder else frozenset()
    overlap_pass = _OverlapPass(bucketing, plan, reorder, cpu, estimator, recorder, sink_groups, fingerprint or "")
    if fingerprint:
        _keep_comm_plan(recorder, fingerprint, overlap_pass.uuid(), session)
    # One options dict (one pass object) for every module: Dynamo then reuses one module's compiled code for
    # another of the same class whose guards pass (regional compilation), instead of compiling it again.
    options = {**rank_local_compile_options(), **gpu_scheduling_options(cpu, bucketing), **(extra_options or {}),
               "post_grad_custom_post_pass": overlap_pass}
    kwargs = {"backend": session.backend(options)} if session is not None else {"backend": backend, "options": options}
    for module in modules:
        module.compile(fullgraph=fullgraph, **kwargs)
    recorder.compile_kwargs = kwargs
    return recorder


def _keep_comm_plan(recorder: CommPlanRecorder, fingerprint: str, pass_uuid: str, session: CompileOnce | None) -> None:
    """Where the recorder keeps its plan for a start that loads the graphs (``cache.comm_plan_store``), and under
    compile once where the leader keeps its own (a follower loads the leader's graphs, so it records nothing)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    recorder.store = comm_plan_store(fingerprint, pass_uuid, rank)
    if recorder.store.exists() and read_stored_plan(recorder.store) is None:
        # Graphs loaded from the cache record no plan: this process compiles them again, and writes a new copy.
        recorder.store.unlink(missing_ok=True)
        disable_compile_caches()
        logger.warning("compile: the comm plan's copy was unreadable (removed); rank %d compiles its graphs again, "
                       "without torch's compile caches, to record it", rank)
    if session is not None and session.leader != rank:
        recorder.leader_store = comm_plan_store(fingerprint, pass_uuid, session.leader)

