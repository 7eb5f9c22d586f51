"""torch.compile for SimpleFSDP models, with Inductor's collective bucketing and reordering.

This is the ONE module of the project that touches Inductor internals. Everything private is imported at the
top (``_PRIVATE``) and ``tests/test_compile.py::test_inductor_private_apis_exist`` fails loudly when a torch
upgrade removes one.

    compile_model(model, backend="inductor", bucketing="transformer_block", manual_plan=None, reorder=True,
                  dump_folder="outputs")

compiles ``model`` in place (``nn.Module.compile``: module tree and state_dict names unchanged). All Inductor
settings go through ``torch.compile(..., options=...)``, i.e. they are patched for this compile only; nothing
global is mutated. Our own post-grad pass (``post_grad_custom_post_pass``) runs on the forward and the
backward graph and does, in order:

* **bucketing** (SimpleFSDP paper section 4):
  - ``"none"``: one all-gather / reduce-scatter per parameter, as traced;
  - ``"transformer_block"`` / manual: ``manual_plan`` (one entry per bucket: a module FQN or a list of FQNs;
    ``transformer_block_plan(model)`` = embeddings, each block, [norm, output]) is handed to Inductor's
    ``manual_overlap_bucketing``, which finds each module's nodes through their ``nn_module_stack`` /
    ``fwd_nn_module_stack`` metadata (so the same plan works on forward and backward graphs) and merges
    every FSDP all-gather (forward and backward) and reduce-scatter (backward) of a bucket into one;
  - ``"auto"``: Inductor's overlap scheduler with overlap-preserving bucketing (``schedule_overlap_bucketing``
    with ``collective_bucketing=True``), which greedily buckets collectives that its runtime model says can
    be hidden behind compute.
* **reordering** (``reorder``): manual mode - Inductor's manual reorder: block i+1's all-gather is issued
  before block i's compute (forward and backward prefetch), and block i's reduce-scatter wait is deferred
  past block i-1's; ``none`` + reorder: the overlap scheduler without bucketing; ``auto`` always reorders (its
  bucketing is overlap-driven), ``reorder=False`` is ignored there with a warning.
  The chosen order is pinned with Inductor's ``control_deps`` (``insert_overlap_deps``): without it,
  Inductor's own scheduler moves each all-gather back next to its wait and nothing overlaps.
  ``overlap_in_generated_code`` reads the generated code to check.
* **comm plan**: the final graph's collectives, recorded (and written to ``dump_folder``) - see
  ``CommPlanRecorder``.

Runtime estimates (auto / reorder with ``none``): on GPU Inductor's own (analytical NCCL model, benchmarked
compute). On CPU those need triton / CUDA, so ``CpuRuntimeEstimator`` is plugged in through the scheduler's
``custom_runtime_estimation`` hook: collective time = latency + bytes / bandwidth calibrated on the live process
group, compute time = FLOPs / a measured matmul rate; the roofline helpers the scheduler calls regardless are
pointed at the measured rates while our pass runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

# --- Inductor private APIs (the commented imports): every one the project uses, in this one place. ----------
import torch._inductor.config as inductor_config  # post_grad_custom_post_pass, aten_distributed_optimizations
import torch.distributed as dist
import torch.utils._runtime_estimation as _runtime_estimation  # roofline: get_gpu_dram_gbps, get_device_tflops
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass  # the post-grad pass protocol
from torch._inductor.fx_passes import control_dependencies  # control_deps: the HOP that pins our order
from torch._inductor.fx_passes.overlap_manual_scheduling import (  # manual (module-plan) bucketing + reorder
    ManualOverlapScheduler,
    manual_overlap_bucketing,
)
from torch._inductor.fx_passes.overlap_scheduling import (  # auto bucketing + reorder; "is this compute?"
    is_compute_node,
    schedule_overlap_bucketing,
)
from torch._inductor.utils import run_and_get_code  # the generated wrapper code (checks what really overlaps)

# (module, attribute) pairs the test checks; keep in sync with the imports above and the uses below.
_PRIVATE = (
    (inductor_config, "post_grad_custom_post_pass"),
    (inductor_config, "aten_distributed_optimizations"),
    (_runtime_estimation, "get_gpu_dram_gbps"),
    (_runtime_estimation, "get_device_tflops"),
    (ManualOverlapScheduler, "_manual_bucket_collectives"),
    (ManualOverlapScheduler, "_obtain_nodes_in_subgraph"),
    (control_dependencies, "control_deps"),
    (torch._inductor.utils, "run_and_get_code"),
)
# ------------------------------------------------------------------------------------------------------------

logger = logging.getLogger(__name__)

BUCKETING_MODES = ("none", "transformer_block", "auto")
_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_DATA_OPS = {
    _aten.cat, _aten.split_with_sizes, _aten.split, _aten.copy_, _aten.copy, _aten._to_copy, _aten.clone,
    _aten.constant_pad_nd, _aten.empty, _aten.new_empty,
}
_KINDS = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    _c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    _c10d.all_reduce_coalesced.default: "all_reduce",
    _c10d.all_to_all_single.default: "all_to_all",
}


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


# ------------------------------------------------------------------------------------------ runtime model


class CpuRuntimeEstimator:
    """``custom_runtime_estimation(node, override_size) -> ms``: collectives from a latency + bandwidth fit
    made on the live process group, matmul-like ops from FLOPs at a measured rate, everything else ``None``
    (the scheduler then treats it as free). Picklable numbers only, so it is the same on every rank."""

    def __init__(self, latency_ms: float, bytes_per_ms: float, flops_per_ms: float, mem_bytes_per_ms: float):
        self.latency_ms, self.bytes_per_ms = latency_ms, bytes_per_ms
        self.flops_per_ms, self.mem_bytes_per_ms = flops_per_ms, mem_bytes_per_ms

    @classmethod
    def calibrate(cls, group: dist.ProcessGroup | None = None) -> CpuRuntimeEstimator:
        """Time a few all-gathers and a matmul; every rank takes the slowest rank's figures (all_reduce MAX),
        so all ranks make the same scheduling decisions."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        sizes = (1 << 10, 1 << 20)  # elements (fp32): 4 KiB and 4 MiB per rank
        times = []
        for n in sizes:
            x = torch.ones(n)
            out = torch.empty(n * world)
            reps = 5
            if world > 1:
                dist.all_gather_single(out, x, group=group)  # warm-up
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_gather_single(out, x, group=group)
                times.append((time.perf_counter() - t0) * 1e3 / reps)
            else:
                times.append(0.0)
        a = torch.randn(256, 256)
        torch.mm(a, a)
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        mm_ms = (time.perf_counter() - t0) * 1e3 / 10
        b = torch.randn(1 << 20)
        t0 = time.perf_counter()
        for _ in range(5):
            b.clone()
        copy_ms = (time.perf_counter() - t0) * 1e3 / 5
        # Slowest rank wins: max of times (so min of rates).
        stats = torch.tensor([times[0], times[1], mm_ms, copy_ms], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        t_small, t_big, mm_ms, copy_ms = stats.tolist()
        bytes_small, bytes_big = sizes[0] * 4 * world, sizes[1] * 4 * world
        bytes_per_ms = (bytes_big - bytes_small) / max(t_big - t_small, 1e-6)
        latency_ms = max(t_small - bytes_small / bytes_per_ms, 1e-3)
        flops_per_ms = 2 * 256**3 / max(mm_ms, 1e-6)
        mem_bytes_per_ms = 2 * (1 << 20) * 4 / max(copy_ms, 1e-6)
        return cls(latency_ms, bytes_per_ms, flops_per_ms, mem_bytes_per_ms)

    def collective_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms

    def __call__(self, node: fx.Node, override_size: int | None = None) -> float | None:
        if node.op != "call_function":
            return None
        if node.target in _KINDS:
            return self.collective_ms(override_size if override_size is not None else _collective_bytes(node))
        if is_compute_node(node):
            flops = _node_flops(node)
            return None if flops is None else flops / self.flops_per_ms
        return None

@contextlib.contextmanager
def _cpu_roofline(estimator: CpuRuntimeEstimator | None):
    """Inductor's roofline helper, which its schedulers call for every compute node even with a custom
    estimator (and the manual scheduler, which ignores the estimates), asks triton / CUDA for the GPU's peak
    FLOP/s and DRAM bandwidth. On CPU, answer with the measured rates (or nominal ones) while our pass runs;
    restored afterwards."""
    flops_per_ms = estimator.flops_per_ms if estimator else 1e8  # nominal: 100 GFLOP/s, 10 GB/s
    bytes_per_ms = estimator.mem_bytes_per_ms if estimator else 1e7
    tflops = flops_per_ms * 1e3 / 1e12 / 0.75  # flops_to_ns divides by 0.75 * peak
    gbps = bytes_per_ms * 1e3 / 1e9
    saved = _runtime_estimation.get_device_tflops, _runtime_estimation.get_gpu_dram_gbps
    _runtime_estimation.get_device_tflops = lambda dtype: tflops
    _runtime_estimation.get_gpu_dram_gbps = lambda: gbps
    try:
        yield
    finally:
        _runtime_estimation.get_device_tflops, _runtime_estimation.get_gpu_dram_gbps = saved


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _node_flops(node: fx.Node) -> int | None:
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(node.target, "overloadpacket", None)) or flop_registry.get(node.target)
    if fn is None:
        return None
    args, kwargs, out = torch.utils._pytree.tree_map(_val, (node.args, node.kwargs, node))
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 -- a shape we cannot price: let the scheduler treat it as free
        return None


def _tensor_bytes(v: Any) -> int:
    flat, _ = torch.utils._pytree.tree_flatten(v)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _op_node(node: fx.Node) -> fx.Node:
    """``node`` itself, or, where Inductor wrapped it in ``control_deps(deps, subgraph, *inputs)`` to keep it in
    order (``insert_overlap_deps``; same name and meta), the op node inside that subgraph."""
    if node.op != "call_function" or node.target is not control_dependencies.control_deps:
        return node
    subgraph = getattr(node.graph.owning_module, node.args[1].target)
    return next(n for n in subgraph.graph.nodes if n.op == "call_function")


def _unwrap(node: fx.Node) -> tuple[Any, tuple, dict]:
    """``(target, args, kwargs)`` of the op ``node`` runs, arguments in terms of the outer graph's nodes."""
    inner = _op_node(node)
    if inner is node:
        return node.target, node.args, node.kwargs
    placeholders = [p for p in inner.graph.nodes if p.op == "placeholder"]
    outer = dict(zip(placeholders, node.args[2:], strict=True))
    args, kwargs = fx.node.map_arg((inner.args, inner.kwargs), lambda a: outer.get(a, a))
    return inner.target, args, kwargs


def _target(node: fx.Node) -> Any:
    return _unwrap(node)[0]


def _inputs(node: fx.Node) -> list[fx.Node]:
    """The data inputs of ``node`` (not the ordering-only deps of a ``control_deps`` wrapper)."""
    found: list[fx.Node] = []
    fx.node.map_arg(_unwrap(node)[1:], lambda a: found.append(a) or a)
    return list(dict.fromkeys(found))


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and is_compute_node(_op_node(node))


def _collective_of_wait(wait: fx.Node) -> fx.Node | None:
    arg = _unwrap(wait)[1][0]
    while isinstance(arg, fx.Node) and _target(arg) is operator.getitem:  # coalesced: wait(getitem(coll, i))
        arg = _unwrap(arg)[1][0]
    return arg if isinstance(arg, fx.Node) and _target(arg) in _KINDS else None


def _collective_bytes(node: fx.Node) -> int:
    """Bytes on the wire per rank's view: the gathered output of an all-gather, the input of a reduce-scatter
    / all-reduce."""
    kind = _KINDS.get(_target(node))
    if kind == "all_gather":
        return _tensor_bytes(_val(node))
    return _tensor_bytes(_val(_unwrap(node)[1][0]))


def _collective_dtype(node: fx.Node) -> str:
    flat, _ = torch.utils._pytree.tree_flatten(_val(node))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in flat if isinstance(t, torch.Tensor)})
    return ",".join(dtypes)


# ------------------------------------------------------------------------------------------- comm plan


def _module_fqn(node: fx.Node) -> str | None:
    """Innermost module path of a node, from Dynamo's ``nn_module_stack`` (forward) or the
    ``fwd_nn_module_stack`` AOTAutograd copies onto backward nodes."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _clean_fqn(path)


def _clean_fqn(path: str) -> str:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    parts = re.findall(r"\['([^']+)'\]", path)
    return ".".join(parts) if parts else path


def _moves_data(n: fx.Node) -> bool:
    """Ops between a parameter (or its gradient) and the collective that only move, cast or regroup data:
    views, copies, concatenation / splitting (our buckets), casts, waits, non-aten (bucketing) ops."""
    target = _target(n)
    if target is operator.getitem or target is _c10d.wait_tensor.default:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if target.namespace != "aten":
        return True
    if any(r.alias_info is not None for r in target._schema.returns):
        return True
    return target.overloadpacket in _DATA_OPS


def _carried_modules(start: fx.Node, wait: fx.Node | None, max_nodes: int = 2000) -> list[str]:
    """Best effort: the modules that consume an all-gather's result (through data-movement ops), or that
    produce a reduce-scatter's input (the gradient computations)."""
    found: dict[str, None] = {}
    forward = _KINDS[_target(start)] == "all_gather" and wait is not None
    queue = [*start.users, *wait.users] if forward else _inputs(start)
    seen: set[fx.Node] = set()
    while queue and len(seen) < max_nodes:
        n = queue.pop(0)
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if _moves_data(n):
            queue.extend(n.users if forward else _inputs(n))
        elif (fqn := _module_fqn(n)) is not None:
            found[fqn] = None
    return sorted(found)


def describe_collectives(graph: fx.Graph) -> list[dict[str, Any]]:
    """Every collective of ``graph`` in issue order: kind, process group, dtype, bytes, modules carried, and the
    compute nodes issued between it and its wait (empty: exposed)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    waits: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "call_function" and _target(n) is _c10d.wait_tensor.default:
            start = _collective_of_wait(n)
            if start is not None:
                waits[start] = max(waits.get(start, n), n, key=pos.__getitem__)  # coalesced: the last wait
    out = []
    for n in nodes:
        if n.op != "call_function" or _target(n) not in _KINDS:
            continue
        wait = waits.get(n)
        end = pos[wait] if wait is not None else pos[n]
        overlapped = [m for m in nodes[pos[n] + 1 : end] if _is_compute(m)]
        target, args, _ = _unwrap(n)
        out.append(
            {
                "index": len(out),
                "node": n.name,
                "kind": _KINDS[target],
                "group": str(args[-1]),  # the process group's name
                "dtype": _collective_dtype(n),
                "bytes": _collective_bytes(n),
                "modules": _carried_modules(n, wait),
                "overlaps": [
                    {"node": m.name, "op": str(_target(m)), "module": _module_fqn(m)} for m in overlapped
                ],
                "exposed": not overlapped,
            }
        )
    return out


def overlap_in_generated_code(fn: Callable[[], Any]) -> list[list[int]]:
    """Run ``fn`` (which must trigger compilation) and read Inductor's generated wrapper code: for each graph,
    per collective in issue order, how many compute kernels (matmuls, fused C++/Triton kernels) run between
    its start and its wait. The comm plan shows the order our pass chose; this shows the order that runs."""
    _, codes = run_and_get_code(fn)
    result = []
    for code in codes:
        started: dict[str, int] = {}
        gaps: list[int] = []
        kernels = 0
        for line in code[code.find("def call"):].splitlines():
            if "_c10d_functional." in line and ("all_gather" in line or "reduce_scatter" in line
                                                or "all_reduce" in line):
                out = re.search(r"out=(\w+)", line) or re.match(r"\s*(\w+) = ", line)
                if out:
                    started[out.group(1)] = kernels
            elif (wait := re.search(r"wait_tensor\.default\((\w+)\)", line)) and wait.group(1) in started:
                gaps.append(kernels - started.pop(wait.group(1)))
            elif "extern_kernels." in line or re.search(r"\b(cpp|triton)_\w+(\.run)?\(", line):
                kernels += 1
        result.append(gaps)
    return result


class CommPlanRecorder:
    """Collects the collectives of each compiled graph (forward, backward) and writes
    ``comm_plan.json`` / ``comm_plan.txt`` under ``dump_folder`` whenever a graph is added (the backward graph
    is compiled during the first backward, so after the first compiled step both are there)."""

    def __init__(self, dump_folder: str | None, settings: dict[str, Any]):
        self.dump_folder = dump_folder
        self.settings = settings
        self.graphs: dict[str, list[dict[str, Any]]] = {}

    def add(self, graph: fx.Graph) -> None:
        is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        name = "backward" if is_backward else "forward"
        if name in self.graphs:  # a recompilation: keep each one
            name = f"{name}_{sum(k.startswith(name) for k in self.graphs)}"
        self.graphs[name] = describe_collectives(graph)
        logger.info("comm plan %s: %s", name, self.summary_line(self.graphs[name]))
        self.write()

    @staticmethod
    def summary_line(colls: list[dict[str, Any]]) -> str:
        counts, sizes = Counter(), Counter()
        exposed = sum(c["exposed"] for c in colls)
        for c in colls:
            counts[c["kind"]] += 1
            sizes[c["kind"]] += c["bytes"]
        parts = [f"{counts[k]} {k} ({sizes[k] / 2**20:.2f} MiB)" for k in sorted(counts)]
        return (", ".join(parts) or "no collectives") + f"; {exposed} exposed"

    def counts(self, graph: str) -> dict[str, int]:
        return dict(Counter(c["kind"] for c in self.graphs.get(graph, [])))

    def write(self) -> None:
        if self.dump_folder is None:
            return
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        os.makedirs(self.dump_folder, exist_ok=True)
        with open(os.path.join(self.dump_folder, "comm_plan.json"), "w") as f:
            json.dump({"settings": self.settings, "graphs": self.graphs}, f, indent=1)
        lines = [f"settings: {json.dumps(self.settings)}"]
        for name, colls in self.graphs.items():
            lines.append(f"\n== {name}: {self.summary_line(colls)}")
            for c in colls:
                if c["exposed"]:
                    overlap = "EXPOSED"
                else:
                    mods = sorted({o["module"] or "?" for o in c["overlaps"]})
                    overlap = f"overlaps {len(c['overlaps'])} compute ops in {', '.join(mods)}"
                lines.append(
                    f"{c['index']:4d} {c['kind']:<15s} {c['dtype']:<9s} {c['bytes']:>12,d} B  "
                    f"[{', '.join(c['modules']) or '?'}]  {overlap}"
                )
        with open(os.path.join(self.dump_folder, "comm_plan.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------- the pass


class _OverlapPass(CustomGraphPass):
    """Our post-grad pass: bucket / reorder the collectives, then record them. ``uuid()`` is ``None``: the
    pass is not cacheable, so Inductor's FX graph cache is bypassed and the pass (and the recording) always
    runs."""

    def __init__(self, bucketing: str, plan, reorder: bool, cpu: bool, estimator, recorder: CommPlanRecorder):
        self.bucketing, self.plan, self.reorder, self.cpu = bucketing, plan, reorder, cpu
        self.estimator, self.recorder = estimator, recorder

    def uuid(self) -> None:
        return None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        has_collectives = any(n.op == "call_function" and n.target in _KINDS for n in graph.nodes)
        with _cpu_roofline(self.estimator) if self.cpu else contextlib.nullcontext():
            self._bucket_and_reorder(gm, has_collectives)
        self.recorder.add(graph)

    def _bucket_and_reorder(self, gm: fx.GraphModule, has_collectives: bool) -> None:
        if has_collectives and self.plan is not None:
            if self.reorder:
                # insert_overlap_deps: pin the order we chose with control_deps. Without them Inductor's own
                # scheduler (peak-memory reordering) sinks every all-gather back next to its wait, and the
                # generated code overlaps nothing (measured: 0 compute kernels between any start and wait).
                manual_overlap_bucketing(gm, self.plan, insert_overlap_deps=True)
            else:
                scheduler = ManualOverlapScheduler(gm, self.plan, insert_overlap_deps=False)
                scheduler._manual_bucket_collectives()
                gm.recompile()
        elif has_collectives and (self.bucketing == "auto" or self.reorder):
            auto = self.bucketing == "auto"
            # With tensor parallel the graph also holds TP's activation collectives, whose gathered outputs
            # are saved for backward; Inductor's bucketer asserts a single user and fails on them ("Expected
            # single user for all_gather_into_tensor", torch 2.13). Bucket only the process groups that carry
            # FSDP all-gathers (of parameters), i.e. the data-parallel ones.
            groups = {n.args[-1] for n in gm.graph.nodes if n.op == "call_function" and n.target in _KINDS}
            kwargs: dict[str, Any] = dict(
                collective_bucketing=auto,
                pre_bucketing_fsdp_collectives=False,
                insert_overlap_deps=True,  # as for manual: keep the overlap in the generated code
                bucket_only_internode_comms=len(groups) > 1,
            )
            if self.estimator is not None:
                kwargs.update(custom_runtime_estimation=self.estimator, compute_estimator="analytical")
            schedule_overlap_bucketing(gm, **kwargs)
            gm.recompile()


_CALIBRATED: CpuRuntimeEstimator | None = None


def known_problem(bucketing: str, reorder: bool, cpu: bool) -> str | None:
    """A setting known to misbehave here, as a warning to print, or None."""
    if cpu and bucketing == "none" and reorder:
        # Measured in the benchmark (debugmodel_large, seq 512): a rank died with heap corruption ("malloc():
        # unaligned tcache chunk detected") or SIGSEGV in 4 of 17 compute-heavy runs, with and without our
        # control_deps; never with transformer_block or auto. Not root-caused. A faulthandler trace put the abort
        # at an allocation inside the compiled forward, where up to 66 of its 75 all-gathers were in flight at
        # once (the scheduler hoists them all; max_in_flight_gb=5 does not bind); the generated code reuses
        # no buffer of an in-flight collective. Capping the scheduler (max_in_flight_gb=0.05: at most 36 in
        # flight) did not help: 2 crashes in 12 runs. The suspect stays gloo under concurrent operations.
        return ("compile: bucketing = 'none' with reorder = true has crashed intermittently on CPU / gloo "
                "(heap corruption in one rank, 4 of 17 benchmark runs); use bucketing = 'transformer_block' or "
                "'auto'.")
    return None


def compile_model(
    model: nn.Module,
    *,
    backend: str = "inductor",
    bucketing: str = "none",
    manual_plan: Sequence[str | Sequence[str]] | None = None,
    reorder: bool = False,
    dump_folder: str | None = None,
    fullgraph: bool = True,
) -> CommPlanRecorder | None:
    """Compile ``model`` in place with the given collective bucketing / reordering; return the comm-plan
    recorder (``None`` for non-Inductor backends, which run no Inductor passes).

    ``bucketing``: ``none`` | ``transformer_block`` | ``auto``. ``manual_plan`` overrides the
    ``transformer_block`` plan (one entry per bucket: a module FQN or a list of FQNs). ``dump_folder``: where
    ``comm_plan.json`` / ``.txt`` go (rank 0). Must be called on every rank (the CPU estimator calibrates
    with collectives).
    """
    if bucketing not in BUCKETING_MODES:
        raise ValueError(f"compile_model: bucketing must be one of {BUCKETING_MODES}, got {bucketing!r}.")
    if backend != "inductor":
        if bucketing != "none" or reorder or manual_plan:
            warnings.warn(
                f"compile backend {backend!r} runs no Inductor passes: bucketing/reorder ignored.", stacklevel=2
            )
        model.compile(backend=backend, fullgraph=fullgraph)
        return None
    if bucketing == "auto" and manual_plan:
        raise ValueError("compile_model: a manual_plan needs bucketing 'transformer_block' (manual), not 'auto'.")
    if bucketing == "auto" and not reorder:
        warnings.warn("compile: bucketing='auto' always reorders (its buckets are chosen for overlap).", stacklevel=2)
    plan = [list(p) if not isinstance(p, str) else p for p in manual_plan] if manual_plan else None
    if bucketing == "transformer_block" and plan is None:
        plan = transformer_block_plan(model)
    if bucketing == "none":
        plan = None
    estimator = None
    cpu = not torch.cuda.is_available()
    if (problem := known_problem(bucketing, reorder, cpu)) is not None:
        warnings.warn(problem, stacklevel=2)
    needs_estimates = bucketing == "auto" or (bucketing == "none" and reorder)
    if needs_estimates and cpu:
        global _CALIBRATED
        if _CALIBRATED is None:  # once per process: every rank calibrates together (collectives)
            _CALIBRATED = CpuRuntimeEstimator.calibrate()
        estimator = _CALIBRATED
        logger.info(
            "compile: CPU runtime model: collective %.3f ms + bytes / %.1f MB/s, matmul %.1f GFLOP/s",
            estimator.latency_ms, estimator.bytes_per_ms / 1e3, estimator.flops_per_ms / 1e6,
        )
    settings = {"bucketing": bucketing, "reorder": reorder, "plan": plan}
    recorder = CommPlanRecorder(dump_folder, settings)
    options = {"post_grad_custom_post_pass": _OverlapPass(bucketing, plan, reorder, cpu, estimator, recorder)}
    model.compile(backend=backend, fullgraph=fullgraph, options=options)
    return recorder
