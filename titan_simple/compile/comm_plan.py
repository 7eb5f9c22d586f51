"""The comm plan: the collectives of each compiled graph, read from the post-grad FX graph after our pass has
bucketed and reordered it.

``describe_collectives(graph)`` lists the collectives in issue order. For each one it gives the kind, process
group, dtype, bytes, the modules whose parameters / gradients it carries, and the compute issued between its
start and its wait (none: exposed). ``CommPlanRecorder`` keeps one such list per compiled graph (forward,
backward) and writes ``comm_plan.json`` / ``comm_plan.txt``. The nodes may be wrapped in Inductor's
``control_deps`` (that is how the order is pinned), so every reader here looks through the wrapper.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from titan_simple.compile.inductor_private import OpOverload, control_deps, is_compute_node, op_schema, tree_flatten

logger = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# Functional collective op -> kind, for the ops our graphs can contain (plain and coalesced forms).
COLLECTIVE_KINDS: dict[OpOverload, str] = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    _c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    _c10d.all_reduce_coalesced.default: "all_reduce",
    _c10d.all_to_all_single.default: "all_to_all",
}
_DATA_OPS = {
    _aten.cat, _aten.split_with_sizes, _aten.split, _aten.copy_, _aten.copy, _aten._to_copy, _aten.clone,
    _aten.constant_pad_nd, _aten.empty, _aten.new_empty,
}


# ------------------------------------------------------------------------------------------ reading nodes


def meta_value(n: Any) -> Any:
    """The fake value an FX node stands for (``meta['val']``); anything else unchanged."""
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _tensor_bytes(v: Any) -> int:
    flat, _ = tree_flatten(v)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _op_node(node: fx.Node) -> fx.Node:
    """``node`` itself, or the op node inside the subgraph when Inductor wrapped ``node`` in
    ``control_deps(deps, subgraph, *inputs)`` to keep it in order (``insert_overlap_deps``). The wrapper keeps
    the node's name and meta."""
    if node.op != "call_function" or node.target is not control_deps:
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
    """The data inputs of ``node``, without the ordering-only deps of a ``control_deps`` wrapper."""
    found: list[fx.Node] = []
    fx.node.map_arg(_unwrap(node)[1:], lambda a: found.append(a) or a)
    return list(dict.fromkeys(found))


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and is_compute_node(_op_node(node))


def _collective_of_wait(wait: fx.Node) -> fx.Node | None:
    arg = _unwrap(wait)[1][0]
    while isinstance(arg, fx.Node) and _target(arg) is operator.getitem:  # coalesced: wait(getitem(coll, i))
        arg = _unwrap(arg)[1][0]
    return arg if isinstance(arg, fx.Node) and _target(arg) in COLLECTIVE_KINDS else None


def overlap_order(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """The ordering that makes ``graph``'s overlap real, as ``{node: [nodes it must run after]}``: for each
    collective with compute between its start and its wait in the graph's order, the first of that compute runs
    after the start, and the wait after the last of it (the compute the collective is meant to hide behind)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    compute = [n for n in nodes if _is_compute(n)]
    order: dict[fx.Node, list[fx.Node]] = {}
    for wait in nodes:
        if wait.op != "call_function" or _target(wait) is not _c10d.wait_tensor.default:
            continue
        start = _collective_of_wait(wait)
        if start is None:
            continue
        between = [c for c in compute if pos[start] < pos[c] < pos[wait]]
        if between:
            order.setdefault(between[0], []).append(start)
            order.setdefault(wait, []).append(between[-1])
    return order


def sink_last_reduce_scatter_waits(graph: fx.Graph, groups: set[str]) -> int:
    """Move the waits of ``graph``'s last gradient reductions on the process groups ``groups`` (the data-parallel
    ones: reduce-scatters, and all-reduces under replicate / hybrid_shard), those waited after every other such
    reduction has started, with everything that uses their results, to just before the output; return how many
    waits moved.

    Inductor's manual overlap defers a reduction's wait past the next reduction's start, so the last one has none
    to wait for: it is waited where it was issued. In a regional graph whose first weights were handed in
    (``regions.py``) that last one is the first block's ``wo``, issued before the attention's backward and the
    q / k / v projections' backward, which could hide it. Its results are graph outputs (the sharded gradients,
    and their casts), so the move only lets that compute run between the start and the wait (``overlap_order``
    then pins it). Tensor parallel's reduce-scatters (other groups) stay where they are."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    def reduction(node: fx.Node | None) -> bool:
        return (node is not None and node.op == "call_function"
                and COLLECTIVE_KINDS.get(_target(node)) in ("reduce_scatter", "all_reduce")
                and str(_unwrap(node)[1][-1]) in groups)

    starts = [pos[n] for n in nodes if reduction(n)]
    if not starts:
        return 0
    waits = [n for n in nodes[max(starts) + 1:] if n.op == "call_function"
             and _target(n) is _c10d.wait_tensor.default and reduction(_collective_of_wait(n))]
    moving: set[fx.Node] = set()
    pending = list(waits)
    while pending:
        node = pending.pop()
        if node.op != "output" and node not in moving:
            moving.add(node)
            pending.extend(node.users)
    output = next(n for n in reversed(nodes) if n.op == "output")
    for node in sorted(moving, key=pos.__getitem__):
        output.prepend(node)
    return len(waits)


def collective_bytes(node: fx.Node) -> int:
    """Bytes on the wire as one rank sees them: the gathered output of an all-gather, the input of a
    reduce-scatter / all-reduce."""
    kind = COLLECTIVE_KINDS.get(_target(node))
    if kind == "all_gather":
        return _tensor_bytes(meta_value(node))
    return _tensor_bytes(meta_value(_unwrap(node)[1][0]))


def _collective_dtype(node: fx.Node) -> str:
    flat, _ = tree_flatten(meta_value(node))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in flat if isinstance(t, torch.Tensor)})
    return ",".join(dtypes)


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
    """Whether ``n`` only moves, casts or regroups data on the way between a parameter (or its gradient) and
    the collective: views, copies, concatenation / splitting (our buckets), casts, waits, and non-aten
    (bucketing) ops."""
    target = _target(n)
    if target is operator.getitem or target is _c10d.wait_tensor.default:
        return True
    if not isinstance(target, OpOverload):
        return True
    if target.namespace != "aten":
        return True
    if any(r.alias_info is not None for r in op_schema(target).returns):
        return True
    return target.overloadpacket in _DATA_OPS


def _carried_modules(start: fx.Node, wait: fx.Node | None, max_nodes: int = 2000) -> list[str]:
    """Best effort: the modules that consume an all-gather's result (through data-movement ops), or that
    produce a reduce-scatter's input (the gradient computations)."""
    found: dict[str, None] = {}
    forward = COLLECTIVE_KINDS[_target(start)] == "all_gather" and wait is not None
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


# ------------------------------------------------------------------------------------------- comm plan


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
        if n.op != "call_function" or _target(n) not in COLLECTIVE_KINDS:
            continue
        wait = waits.get(n)
        end = pos[wait] if wait is not None else pos[n]
        overlapped = [m for m in nodes[pos[n] + 1 : end] if _is_compute(m)]
        target, args, _ = _unwrap(n)
        out.append(
            {
                "index": len(out),
                "node": n.name,
                "kind": COLLECTIVE_KINDS[target],
                "group": str(args[-1]),  # the process group's name
                "dtype": _collective_dtype(n),
                "bytes": collective_bytes(n),
                "modules": _carried_modules(n, wait),
                "overlaps": [
                    {"node": m.name, "op": str(_target(m)), "module": _module_fqn(m)} for m in overlapped
                ],
                "exposed": not overlapped,
            }
        )
    return out


def read_stored_plan(store: Path) -> dict[str, list[dict[str, Any]]] | None:
    """The graphs of a comm plan kept in the compile cache; None, with a warning, for a file that cannot be read
    (truncated, not ours): the plan is what the run reports, never a reason to stop it."""
    try:
        graphs = json.loads(store.read_text())["graphs"]
        if isinstance(graphs, dict):
            return graphs
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logger.warning("comm plan: the copy kept in the compile cache at %s is unreadable; ignored", store)
    return None


class CommPlanRecorder:
    """Collects the collectives of each compiled graph (forward, backward). Each time a graph is added it
    writes ``comm_plan.json`` / ``comm_plan.txt`` under ``dump_folder``. The backward graph is compiled during
    the first backward, so both graphs are there after the first compiled step. ``store``: where this rank
    also keeps its plan for a later start that loads the same graphs from the compile cache (our pass does not
    run then); ``restore()`` reads it back."""

    def __init__(self, dump_folder: str | None, settings: dict[str, Any], store: Path | None = None,
                 group_labels: dict[str, str] | None = None):
        self.dump_folder = dump_folder
        self.settings = settings
        self.store = store
        # torch.compile's backend arguments of the compile it records (compiler.py): another pipeline stage's
        # regions compile with the same ones, so Dynamo reuses their code
        self.compile_kwargs: dict[str, Any] = {}
        self.leader_store: Path | None = None  # compile once: the comm plan of the rank that compiled the graphs
        self.recorded: dict[str, list[dict[str, Any]]] = {}  # what our pass recorded in this process
        # process group name -> the parallelism whose collectives it carries, where it is not the weights' data
        # parallel (context parallel's key / value gathers: "cp"); shown in comm_plan.txt
        self.group_labels: dict[str, str] = group_labels or {}

    @property
    def graphs(self) -> dict[str, list[dict[str, Any]]]:
        """Each compiled graph's collectives: what this process recorded or, when its graphs came from the
        compile cache (nothing recorded), the plan kept by the start or the rank that compiled them."""
        if not self.recorded and (stored := self._stored()) is not None:
            return stored
        return self.recorded

    def _stored(self) -> dict[str, list[dict[str, Any]]] | None:
        for store in (self.store, self.leader_store):
            if store is not None and store.exists() and (graphs := read_stored_plan(store)) is not None:
                return graphs
        return None

    def add(self, graph: fx.Graph) -> None:
        is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        name = "backward" if is_backward else "forward"
        if name in self.recorded:  # a recompilation: keep each one
            name = f"{name}_{sum(k.startswith(name) for k in self.recorded)}"
        self.recorded[name] = describe_collectives(graph)
        for collective in self.recorded[name]:
            if collective["group"] in self.group_labels:
                collective["parallelism"] = self.group_labels[collective["group"]]
        logger.info("comm plan %s: %s", name, self.summary_line(self.recorded[name]))
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

    def restore(self) -> bool:
        """After the first step: if no graph was recorded (they came from the compile cache), read the plan
        kept by the start that compiled them (this rank's, else the compile-once leader's), write it to the dump
        folder; whether it did."""
        stored = None if self.recorded else self._stored()
        if stored is None:
            return False
        self.recorded = stored
        for name, colls in self.recorded.items():
            logger.info("comm plan %s (from the compile cache): %s", name, self.summary_line(colls))
        self.write()
        return True

    def write(self) -> None:
        if self.store is not None:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            partial = self.store.with_suffix(f".partial-{os.getpid()}")
            partial.write_text(json.dumps({"settings": self.settings, "graphs": self.recorded}))
            partial.replace(self.store)  # atomic: a reader never sees half a plan
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
                kind = c["kind"] + (f" ({c['parallelism']})" if "parallelism" in c else "")
                lines.append(
                    f"{c['index']:4d} {kind:<20s} {c['dtype']:<9s} {c['bytes']:>12,d} B  "
                    f"[{', '.join(c['modules']) or '?'}]  {overlap}"
                )
        with open(os.path.join(self.dump_folder, "comm_plan.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
