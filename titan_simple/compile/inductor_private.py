"""The private torch APIs of the compiler (``titan_simple.compile``: Inductor, AOT autograd, Dynamo), all imported
here; the compiler's other modules import them from this one. Only a compiled run imports this module (and with
it Inductor, about a second of every process's start): the parallelisms' private APIs are in
``parallel/torch_private.py``.

A private API may change in any torch release, with no deprecation. ``tests/test_torch_private.py`` checks every
entry of ``PRIVATE_APIS`` here and there and names any that is missing.

A private name that is simply used as is gets re-exported here under a name without the underscore.
Where a private API is a method or a config key, a small function wraps it.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
import torch._functorch.partitioners as partitioners
import torch._inductor.config as inductor_config
import torch._inductor.config_comms as inductor_comms_config
import torch._ops
import torch._prims.rng_prims as rng_prims
import torch.utils._pytree as pytree
import torch.utils._runtime_estimation as runtime_estimation
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd import graph_compile
from torch._inductor import comm_analysis, custom_graph_pass
from torch._inductor import utils as inductor_utils
from torch._inductor.compile_fx import compile_fx
from torch._inductor.fx_passes import (
    control_dependencies,
    micro_pipeline_tp,
    overlap_manual_scheduling,
    overlap_scheduling,
)
from torch._inductor.runtime import cache_dir_utils

# --- re-exports: the names the rest of the package imports ------------------------------------------------
CustomGraphPass = custom_graph_pass.CustomGraphPass
ManualOverlapScheduler = overlap_manual_scheduling.ManualOverlapScheduler
manual_overlap_bucketing = overlap_manual_scheduling.manual_overlap_bucketing
schedule_overlap_bucketing = overlap_scheduling.schedule_overlap_bucketing
is_compute_node = overlap_scheduling.is_compute_node
control_deps = control_dependencies.control_deps
run_and_get_code = inductor_utils.run_and_get_code
OpOverload = torch._ops.OpOverload
tree_map = pytree.tree_map
tree_flatten = pytree.tree_flatten

# (owner, attribute, why we need it). The guard test checks each one with hasattr on the owner.
PRIVATE_APIS: tuple[tuple[object, str, str], ...] = (
    (inductor_config, "post_grad_custom_post_pass",
     "compile.py: the hook that runs our _OverlapPass on the forward and backward graphs"),
    (inductor_config, "aten_distributed_optimizations",
     "not set by us: Inductor's own overlap-scheduling switches (off by default; our pass schedules)"),
    (custom_graph_pass, "CustomGraphPass",
     "compile.py: the base class a post-grad pass must derive from"),
    (overlap_manual_scheduling, "manual_overlap_bucketing",
     "compile.py: manual (module-plan) bucketing + prefetch reorder"),
    (overlap_manual_scheduling, "ManualOverlapScheduler",
     "manual_bucketing_only (compile.py): manual bucketing without the reorder"),
    (ManualOverlapScheduler, "_manual_bucket_collectives",
     "manual_bucketing_only (compile.py): the bucket-only step of the manual scheduler"),
    (ManualOverlapScheduler, "_obtain_nodes_in_subgraph",
     "manual_bucketing_only (compile.py): called by _manual_bucket_collectives, maps our plan to nodes"),
    (overlap_scheduling, "schedule_overlap_bucketing",
     "compile.py: 'auto' bucketing, and reordering with bucketing 'none'"),
    (overlap_scheduling, "OverlapScheduler",
     "schedule_overlap_rank_local: the scheduler class schedule_overlap_bucketing builds, swapped for ours"),
    (overlap_scheduling.OverlapScheduler, "_align_compute_nodes_runtime_estimations_across_all_distributed_ranks",
     "schedule_overlap_rank_local: overridden, as it gathers estimates over the world / asks NCCL's simulator"),
    (overlap_scheduling, "estimate_roofline_runtime_ms",
     "analytical_runtime_ms (GPU): Inductor's roofline estimate of a non-collective node"),
    (comm_analysis, "estimate_nccl_collective_runtime_from_fx_node",
     "analytical_runtime_ms (GPU): Inductor's NCCL formula for a collective, without NCCL's simulator"),
    (inductor_config, "distributed_max_autotune_gemm",
     "compile.py: pinned off (it makes a world group and gathers autotune results over it while compiling)"),
    (dynamo_config, "enable_compiler_collectives",
     "cross_rank_compile_settings: Dynamo's compile-time collectives over all ranks (deadlock under pp)"),
    (functorch_config, "_sync_decision_cross_ranks",
     "cross_rank_compile_settings: the partitioner's all_gather_object over all ranks"),
    (inductor_comms_config, "runtime_estimations_align_across_all_distributed_ranks",
     "cross_rank_compile_settings: the scheduler's all_gather_object over all ranks"),
    (overlap_scheduling, "is_compute_node",
     "comm_plan.py / cpu_cost_model.py: Inductor's own test for a compute node"),
    (control_dependencies, "control_deps",
     "comm_plan.py: the wrapper that pins our order (insert_overlap_deps); the plan reads through it"),
    (control_dependencies, "preserve_node_ordering",
     "add_control_deps (compile.py): pins a collective's wait after the compute it should hide behind"),
    (runtime_estimation, "get_device_tflops",
     "cpu_cost_model.py: replaced on CPU while our pass runs (it asks triton / CUDA for peak FLOP/s)"),
    (runtime_estimation, "get_gpu_dram_gbps",
     "cpu_cost_model.py: replaced on CPU while our pass runs (it asks CUDA for DRAM bandwidth)"),
    (inductor_utils, "run_and_get_code",
     "tests: the generated wrapper code, to check what really overlaps"),
    (torch._ops, "OpOverload",
     "comm_plan.py: tells aten ops from others when walking data-movement ops"),
    (torch.ops.aten.mm.default, "_schema",
     "comm_plan.py: whether an op returns a view (alias_info of its returns)"),
    (pytree, "tree_map", "cpu_cost_model.py: node arguments -> their fake values, for the FLOP formulas"),
    (pytree, "tree_flatten", "comm_plan.py: the tensors of a collective's value (bytes, dtype)"),
    (torch._dynamo.utils, "counters",
     "compile/cache.py, once.py: the FX graph cache's hit / miss / bypass counts, AOT autograd's bypasses"),
    (cache_dir_utils, "cache_dir", "compile/cache.py: the folder torch's compile caches use"),
    (inductor_config, "fx_graph_cache", "compile/cache.py: whether the FX graph cache is on"),
    (cache_dir_utils, "default_cache_dir", "compile/cache.py: tells torch's default folder from the user's"),
    (inductor_config, "_micro_pipeline_tp",
     "async tensor parallel (compile.py): the switch of Inductor's micro-pipelined TP pass"),
    (micro_pipeline_tp, "find_all_gather_patterns",
     "async_tensor_parallel_matches: the all-gather -> matmul pairs the pass would fuse"),
    (micro_pipeline_tp, "find_reduce_scatter_patterns",
     "async_tensor_parallel_matches: the matmul -> reduce-scatter pairs the pass would fuse"),
    (micro_pipeline_tp, "_find_consumer_matmuls",
     "async_tensor_parallel_matches: whether a gathered activation feeds a matmul"),
    (micro_pipeline_tp, "_find_producer_matmul",
     "async_tensor_parallel_matches: whether a reduce-scatter's input is a matmul's output"),
    (partitioners, "functionalize_rng_ops",
     "prepare_compile: wrapped to put recomputed ops' RNG states before the saved DeviceMesh (torch bug)"),
    (graph_compile, "is_opaque_node", "prepare_compile: tells a saved DeviceMesh (opaque object) from a tensor"),
    (rng_prims, "run_and_save_rng_state", "prepare_compile: marks the RNG states functionalize_rng_ops saves"),
    (functorch_config, "enable_autograd_cache",
     "compile/once.py: AOT autograd's cache on for the compiles that are shared across ranks"),
    (inductor_config, "force_disable_caches", "compile/once.py: whether the environment keeps the caches off"),
    (functorch_config, "force_non_lazy_backward_lowering",
     "compile/once.py: the backward compiled with the forward, so the leader's cache entry holds both"),
)


def add_control_deps(graph: torch.fx.Graph, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """Make each node of ``deps`` run after the nodes it maps to, in Inductor's generated code, as
    ``insert_overlap_deps`` does (``preserve_node_ordering`` wraps a node in ``control_deps(deps, subgraph,
    *inputs)``). A node that is already wrapped gets the extra dependencies added to its wrapper's ``deps``.

    Any node kind is safe, multi-output and SymInt-returning ones included (CUDA's flash SDPA returns 9 values,
    2 of them SymInts): the subgraph returns the node's whole value, Inductor lowers it inline with the same
    lowering as the bare node (lowering.py:8685-8717, process_subgraph_nodes) and realizes only the IR nodes among
    the deps (SymInt leaves are skipped); ``tests/test_compile.py`` checks such a node, static and dynamic. What
    wrapping can cost is fusion: the wrapper realizes its deps and pins an order fusion must respect (pytorch
    issue 186084: a LayerNorm fusion split in two, bf16 results shifted). Ours, like torch's own
    ``insert_overlap_deps``, pins only matmul-like compute and collective starts / waits, whose outputs are
    buffers anyway; a GPU run has yet to compare bf16 losses with and without."""
    fresh = {}
    for node, after in deps.items():
        if node.target is control_deps:
            node.args = (tuple(dict.fromkeys((*node.args[0], *after))), *node.args[1:])
        else:
            fresh[node] = list(dict.fromkeys(after))  # torch annotates an OrderedSet; it only iterates it
    control_dependencies.preserve_node_ordering(graph, fresh)


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an aten / c10d op overload (``OpOverload._schema``)."""
    return op._schema


def manual_bucketing_only(gm: torch.fx.GraphModule, plan: list[str | list[str]]) -> None:
    """Inductor's manual bucketing of ``gm`` by module ``plan``, without the reorder that
    ``manual_overlap_bucketing`` adds (``ManualOverlapScheduler._manual_bucket_collectives``)."""
    ManualOverlapScheduler(gm, plan, insert_overlap_deps=False)._manual_bucket_collectives()


def compile_counters() -> dict[str, int]:
    """This process's Inductor FX graph cache hits, misses and bypasses so far (``torch._dynamo.utils.counters``;
    an AOTAutograd cache hit loads its graphs through this cache too, so each compiled graph counts once)."""
    inductor = counters["inductor"]
    return {kind: inductor[f"fxgraph_cache_{kind}"] for kind in ("hit", "miss", "bypass")}


def graph_cache_enabled() -> bool:
    """Whether Inductor's FX graph cache is on (``TORCHINDUCTOR_FX_GRAPH_CACHE``; on by default)."""
    return bool(inductor_config.fx_graph_cache)


def inductor_cache_dir() -> str:
    """The folder torch's compile caches use now (``TORCHINDUCTOR_CACHE_DIR`` or torch's per-user default)."""
    return cache_dir_utils.cache_dir()


def default_inductor_cache_dir() -> str:
    """torch's per-user default for ``TORCHINDUCTOR_CACHE_DIR`` (which importing Inductor sets when unset)."""
    return cache_dir_utils.default_cache_dir()


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith(self.prefixes)

# What torch says on every compiled start that no user can act on (a quiet start).
# * Logged once per process by torch._higher_order_ops.wrap for every selective-checkpoint region under compile:
#   such regions may not hold in-place ops unless their contexts allow it. Ours do hold one (rms_norm's add_)
#   and allow it (activation_checkpoint: allow_cache_entry_mutation=True, with the reason).
_CHECKPOINT_LOGGER = "torch._higher_order_ops.wrap"

_CHECKPOINT_MESSAGES = ("Detected that context_fn is passed to torch.utils.checkpoint under torch.compile",)

# * Inductor's lowering, per graph with complex ops: RoPE's complex multiply runs as the eager kernel (a few
#   elementwise ops per block), which nobody can change from a config.
_COMPLEX_OPS_WARNING = "Torchinductor does not support code generation for complex operators"


def prepare_compile() -> None:
    """What every ``torch.compile`` of ours needs first (idempotent): the fix of torch's RNG functionalization
    below, and a quiet start."""
    _fix_rng_functionalization_with_opaque_saved_values()
    _silence_unactionable_compile_warnings()


def _silence_unactionable_compile_warnings() -> None:
    """Drop the two messages above (idempotent); every other torch warning still reaches the user."""
    checkpoint_logger = logging.getLogger(_CHECKPOINT_LOGGER)
    if not any(isinstance(f, _DropMessages) for f in checkpoint_logger.filters):
        checkpoint_logger.addFilter(_DropMessages(_CHECKPOINT_MESSAGES))
    warnings.filterwarnings("ignore", message=_COMPLEX_OPS_WARNING, category=UserWarning)


def async_tensor_parallel_options() -> dict[str, bool]:
    """The Inductor setting (for ``torch.compile(options=...)``, so it applies to that compile only) that runs
    the micro-pipelined tensor-parallel pass: each all-gather feeding matmuls and each reduce-scatter fed by a
    matmul becomes a fused symmetric-memory kernel that overlaps the transfer with the matmul, chunk by chunk.
    The pass fuses nothing without NCCL, so on CPU it only finds the patterns."""
    return {"_micro_pipeline_tp": True}


def async_tensor_parallel_matches(graph: torch.fx.Graph) -> tuple[int, int]:
    """How many all-gathers feeding matmuls and reduce-scatters fed by a matmul a post-grad ``graph`` holds, as
    Inductor's async-TP pass finds them (its pattern finders and its consumer / producer matmul searches), without
    fusing anything: what the pass would fuse on GPUs."""
    tp = micro_pipeline_tp
    gathers = [m for m in tp.find_all_gather_patterns(graph) if tp._find_consumer_matmuls(m.res_node)]
    reduces = [m for m in tp.find_reduce_scatter_patterns(graph) if tp._find_producer_matmul(m.input_node) is not None]
    return len(gathers), len(reduces)


# --- torch bug: RNG states of recomputed ops land after the saved DeviceMesh ---------------------------------
# Activation checkpointing under compile recomputes ops in backward; for an op tagged ``nondeterministic_seeded``
# (``scaled_dot_product_attention`` is, even with dropout 0) the partitioner's ``functionalize_rng_ops`` makes the
# forward save the RNG state and the backward replay it. On devices without graph-safe RNG (CPU; CUDA takes
# another branch that adds graph inputs, not outputs) it appends each state to the forward's outputs "before the
# symints", and each backward placeholder before the first tangent. But torch 2.13 also saves opaque objects
# there: a DTensor parameter's DeviceMesh, which the backward needs to return DTensor gradients. The states then
# sit after the mesh, the runtime slices the saved tensors by count, and the first compiled step fails with
# "expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh" (full AC and every-N-th-block AC
# with SimpleFSDP; tests/repro_rng_state_after_device_mesh.py). The wrapper moves the states in front
# of the opaque objects, in both graphs, where the runtime expects them.
_original_functionalize_rng_ops = partitioners.functionalize_rng_ops


def _is_saved_rng_state(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
            and getattr(node.args[0], "target", None) is rng_prims.run_and_save_rng_state)


def _rng_states_before_opaque(seq: list, is_state) -> list:
    """``seq`` with its states (``is_state``) moved in front of the run of opaque objects right before them."""
    states = [n for n in seq if is_state(n)]
    if not states:
        return seq
    rest = [n for n in seq if not is_state(n)]
    at = seq.index(states[0])  # nothing before the first state is a state
    while at > 0 and graph_compile.is_opaque_node(rest[at - 1]):
        at -= 1
    return rest[:at] + states + rest[at:]


def _functionalize_rng_ops_before_opaque(joint_module, fw_module, bw_module, num_sym_nodes, *args, **kwargs):
    fw_module, bw_module = _original_functionalize_rng_ops(joint_module, fw_module, bw_module, num_sym_nodes,
                                                           *args, **kwargs)
    output = next(iter(fw_module.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    body, symints = outputs[:len(outputs) - num_sym_nodes], outputs[len(outputs) - num_sym_nodes:]
    fixed = _rng_states_before_opaque(body, lambda n: isinstance(n, torch.fx.Node) and _is_saved_rng_state(n))
    if fixed != body:
        output.args = (tuple(fixed + symints), *output.args[1:])
        placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
        ordered = _rng_states_before_opaque(placeholders, lambda n: n.name.startswith("rng_state_output_"))
        first_non_placeholder = next(n for n in bw_module.graph.nodes if n.op != "placeholder")
        for node in ordered:  # the placeholders again, in the new order
            first_non_placeholder.prepend(node)
        fw_module.recompile()
        bw_module.recompile()
    return fw_module, bw_module


def _fix_rng_functionalization_with_opaque_saved_values() -> None:
    if hasattr(graph_compile, "is_opaque_node"):  # torch 2.11 (on our first GPU) has neither it nor the bug
        partitioners.functionalize_rng_ops = _functionalize_rng_ops_before_opaque


# --- compiling without cross-rank synchronization (a pipeline parallel deadlock otherwise) --------------------
#
# Pipeline stages compile lazily, one after the other, while the ranks of the other stages wait in a P2P receive:
# a compile may only talk to its own stage's process groups. What torch 2.13 would otherwise do while compiling
# (read in its source; every one is off by default or avoided here):
# * overlap_scheduling.py:826-850: OverlapScheduler._align_compute_nodes_runtime_estimations_across_all_
#   distributed_ranks runs dist.all_gather_object over the default (world) group unless both estimators are
#   "analytical" (schedule_overlap_bucketing's default compute_estimator is "benchmark"). Analytical, it still
#   logs every collective's estimate through comm_analysis.estimate_nccl_collective_runtime_from_fx_node with
#   use_nccl_estimator=True (node_runtime_estimation.py:72-87, 415), which on an NCCL group runs the collective
#   under dist._time_estimator (comm_analysis.py:845-890): a ProcessGroupNCCL call during the compile.
#   schedule_overlap_rank_local overrides that method; our estimators price every node themselves.
# * align_estimations_across_ranks (overlap_scheduling.py:1788) and comms.align_runtime_estimations_across_all_
#   distributed_ranks (comms.py:42; scheduler.py:4194, only with reorder_for_compute_comm_overlap and
#   config_comms.runtime_estimations_align_across_all_distributed_ranks): all_gather_object over the world.
# * distributed_autotune.py:60-80, 199 (distributed_max_autotune_gemm): a new world group and an
#   all_gather_object while compiling. Pinned off per compile (compile.py).
# * post_grad.py:285-291 (aten_distributed_optimizations.spmd_check) and :391 (enable_overlap_scheduling, whose
#   default estimator benchmarks and aligns over the world): pinned off per compile (compile.py).
# * _functorch/partitioners.py:3479-3560 (_sync_decision_cross_ranks) and _dynamo/distributed.py:26 + convert_
#   frame.py:1956 (enable_compiler_collectives, env TORCH_COMPILER_COLLECTIVES=1): world collectives; refused
#   under pipeline parallel (cross_rank_compile_settings, core/plan.py).
# * The manual path (overlap_manual_scheduling.py:220-300): ManualOverlapScheduler passes a zero estimator for
#   every collective, skips the baseline memory pass and its run() never calls the alignment: no collective.
# * bucketing.py:1531 (dist.get_rank of a group) and comm_analysis's group sizes are local queries.



class _RankLocalOverlapScheduler(overlap_scheduling.OverlapScheduler):
    """Inductor's overlap scheduler without its cross-rank step (see above)."""

    def _align_compute_nodes_runtime_estimations_across_all_distributed_ranks(self) -> None:
        """Keep the estimates gathered at construction: every rank computes the same ones (ours are derived from
        shapes and rates every rank shares), so there is nothing to align, and nothing is sent to anyone."""


def schedule_overlap_rank_local(gm: torch.fx.GraphModule, **kwargs) -> None:
    """``schedule_overlap_bucketing(gm, **kwargs)`` with ``_RankLocalOverlapScheduler`` as its scheduler class:
    no collective, object collective or NCCL call while it runs. ``kwargs`` must name a
    ``custom_runtime_estimation`` that prices every collective, and ``compute_estimator="analytical"``."""
    if kwargs.get("compute_estimator") != "analytical" or kwargs.get("custom_runtime_estimation") is None:
        raise ValueError("schedule_overlap_rank_local needs compute_estimator='analytical' and an estimator.")
    saved = overlap_scheduling.OverlapScheduler
    overlap_scheduling.OverlapScheduler = _RankLocalOverlapScheduler
    try:
        schedule_overlap_bucketing(gm, **kwargs)
    finally:
        overlap_scheduling.OverlapScheduler = saved


def analytical_runtime_ms(node: torch.fx.Node, override_size: int | None = None) -> float | None:
    """Inductor's own analytical estimate of ``node`` in ms, as its scheduler computes it without a custom
    estimator, but never asking NCCL: a collective from its NCCL formula (bytes, group size, kind; a local
    computation), any other op from the roofline model. The same on every rank of one GPU type."""
    if node.op != "call_function":
        return None
    target = node.target
    if (isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional"
            and target is not torch.ops._c10d_functional.wait_tensor.default):
        return comm_analysis.estimate_nccl_collective_runtime_from_fx_node(
            node, override_size, use_nccl_estimator=False)
    return overlap_scheduling.estimate_roofline_runtime_ms(node)


def rank_local_compile_options() -> dict[str, bool]:
    """Inductor settings (for ``torch.compile(options=...)``, this compile only) pinned off because each makes a
    compile talk to every rank: distributed GEMM autotuning, Inductor's own overlap scheduling (its default
    estimator benchmarks and aligns over the world) and its SPMD graph check. One this torch lacks cannot run: left
    out (torch 2.11, on our first GPU machine, has no ``spmd_check``)."""
    known = inductor_config.get_config_copy()
    return {name: False for name in ("distributed_max_autotune_gemm", "reorder_for_compute_comm_overlap",
                                     "aten_distributed_optimizations.enable_overlap_scheduling",
                                     "aten_distributed_optimizations.spmd_check") if name in known}


def cross_rank_compile_settings() -> list[str]:
    """The settings now on (not in ``rank_local_compile_options``) that make every compile run collectives over
    all ranks, by the name a user sets them with."""
    found = []
    if dynamo_config.enable_compiler_collectives:
        found.append("TORCH_COMPILER_COLLECTIVES=1 (torch._dynamo.config.enable_compiler_collectives)")
    if functorch_config._sync_decision_cross_ranks:
        found.append("torch._functorch.config._sync_decision_cross_ranks")
    if inductor_comms_config.runtime_estimations_align_across_all_distributed_ranks:
        found.append("torch._inductor.config_comms.runtime_estimations_align_across_all_distributed_ranks")
    return found


def compile_graph_with_inductor(graph: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> Any:
    """What ``torch.compile(backend="inductor", options=options)`` runs for one Dynamo graph
    (``torch._TorchCompileInductorWrapper.__call__``: ``compile_fx`` with the options as config patches)."""
    return compile_fx(graph, example_inputs, config_patches=dict(options))


def shared_compile_caches() -> contextlib.AbstractContextManager:
    """While compiling a graph that other ranks will load: Inductor's FX graph cache and AOT autograd's cache on,
    and the backward compiled with the forward, not at the first backward. An environment that forces a cache
    off wins over the patch (``compile_caches_forced_off``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=True))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=True, force_non_lazy_backward_lowering=True))
    return stack


def autograd_cache_bypasses() -> int:
    """How many graphs AOT autograd's cache has refused so far in this process (``counters``; it counts one as soon
    as it computes the graph's key, before compiling)."""
    return counters["aot_autograd"]["autograd_cache_bypass"]


def compile_caches_forced_off() -> list[str]:
    """The environment variables that keep torch's compile caches off whatever a config patch says (torch reads
    them as forced values, ``env_name_force``): a rank cannot load another's graphs while one is set."""
    with shared_compile_caches():
        off = []
        if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
            off.append("TORCHINDUCTOR_FX_GRAPH_CACHE=0 or TORCHINDUCTOR_FORCE_DISABLE_CACHES=1")
        if not functorch_config.enable_autograd_cache:
            off.append("TORCHINDUCTOR_AUTOGRAD_CACHE=0")
        return off
