"""Compile once per job: one rank compiles each graph, the ranks with the same graphs load it from the cache.

    start_compile_once(cache_folder, mesh, device)   # every rank, before the first compile (core/assemble.py)
    ...                                               # CompilePlan compiles through active_session().backend
    logger.info(describe_compile_once(session))       # after step 1, on every rank (a collective)

Every rank of an SPMD job traces the same graphs, and compiling them (AOT autograd, Inductor, the C++ or Triton
compiler) is most of a compiled start: on N ranks it is N copies of the same work, and the slowest rank holds
every collective. Here the ranks whose graphs can be the same form a class, and one rank per class compiles
(the *leader*, its lowest rank) with torch's compile caches on (Inductor's FX graph cache and AOT autograd's,
under the job's cache folder, which every rank must be able to read); the others wait for it and then compile
the same graph, which they find in the cache: only Dynamo's tracing runs on every rank.

**Classes.** A compiled graph names the process groups of its collectives (``_c10d_functional`` ops take the
group's name, a constant of the graph), so ranks in different groups have different graphs. A rank's class is
its pipeline stage and the names of its mesh dimensions' groups (all but ``pp``, whose sends and receives run
outside the compiled graphs): data parallel alone is one class (rank 0 leads), data x pipeline parallel one per
stage; tensor parallel and HSDP put every rank in its own class, so each compiles its own, as before.

**Order and content.** The leader announces graph ``n`` with a digest of it (its Dynamo code and inputs) before
compiling and marks it done after (also when the compile fails). A follower waits for the announcement of its
graph ``n`` (at most ``start_grace_seconds``: a leader that never reaches it has no such graph), then, if the
digests match, for the leader to finish (at most ``max_wait_seconds``) and compiles, loading. A different digest
(a rank-specific graph) compiles at once, and so does a graph AOT autograd's cache refuses (one that traces an
``autograd.Function``, as float8's matmul does): the leader writes ``n.unshared`` as soon as its cache refused
the graph, at key time, and the followers stop waiting. Nothing here decides which code a rank runs:
torch's cache keys hold the whole graph, its settings and torch's version, so a rank whose graph differs misses
and compiles its own. Markers are written under a temporary name and renamed: a reader never sees half of one.

The backward is compiled with the forward (``force_non_lazy_backward_lowering``): compiled lazily, it would be
compiled during a backward whose collectives already need every rank, and AOT autograd's cache entry (forward
and backward together) would only exist after it, so every follower would trace AOT autograd again.

On CUDA, torch's cache keys and generated code name the device index: rank r's ``cuda:r`` graphs are not rank
0's ``cuda:0`` ones. Compile once therefore needs every process to see its one GPU as ``cuda:0``
(``CUDA_VISIBLE_DEVICES`` per rank, as Slurm's ``--gpus-per-task=1`` or a wrapper sets it); where the ranks'
devices differ, ``start_compile_once`` turns it off with one warning and every rank compiles, as before. Written
by reading torch 2.13; no GPU has run it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.compile.inductor_private import (
    autograd_cache_bypasses,
    compile_caches_forced_off,
    compile_counters,
    compile_graph_with_inductor,
    shared_compile_caches,
)

logger = logging.getLogger(__name__)

MARKERS = "titan_simple_compile_once"
_STALE_SECONDS = 24 * 3600  # marker folders of launches untouched this long are removed at start


@dataclass
class GraphRecord:
    """What happened to one graph on this rank."""

    index: int
    seconds: float
    hits: int  # FX graphs (forward, backward) found in the cache
    compiled: int  # FX graphs compiled here (cache misses and graphs the cache cannot hold)
    waited: float = 0.0  # seconds spent waiting for the leader
    same_as_leader: bool = True  # False: this rank's graph differs from the leader's graph of that index
    unshared: bool = False  # AOT autograd's cache refused this graph: every rank compiled it, none waited
    uncached: bool = False  # compiled with torch's caches off (which then count nothing): hits and compiled are 0


@dataclass
class CompileOnce:
    """This rank's part in compiling once. ``leader``: the rank whose graphs this rank loads (itself when it
    leads); ``folder``: this launch's markers, shared by every rank."""

    rank: int
    leader: int
    folder: Path
    cache_folder: str
    start_grace_seconds: float = 300.0
    max_wait_seconds: float = 1800.0
    records: list[GraphRecord] = field(default_factory=list)
    pinned: bool = False  # set by use_session: build_run keeps it instead of starting its own

    @property
    def leads(self) -> bool:
        return self.rank == self.leader

    def backend(self, options: dict[str, Any]) -> CompileOnceBackend:
        return CompileOnceBackend(self, options)

    def compile(self, digest: str, compile_graph: Callable[[], Any]) -> Any:
        """Compile one Dynamo graph (``compile_graph``: Inductor's entry point for it; ``digest`` names its
        content), after the leader has compiled its graph of the same index, or as soon as the leader's cache
        refused it (a follower would only wait to compile it anyway)."""
        index = len(self.records)
        waited, same, unshared = (0.0, True, False) if self.leads else self._wait_for_leader(index, digest)
        if self.leads:
            self._mark(index, "start", digest=digest)
        before = compile_counters()
        start = time.perf_counter()
        try:
            with shared_compile_caches(), self._tell_followers_if_refused(index) as refused:
                compiled = compile_graph()
        finally:
            if self.leads:  # also after a failed compile: no follower waits for it
                self._mark(index, "done")
        after = compile_counters()
        self.records.append(GraphRecord(index, time.perf_counter() - start, after["hit"] - before["hit"],
                                        after["miss"] + after["bypass"] - before["miss"] - before["bypass"], waited,
                                        same, unshared or refused(),
                                        bool(torch.compiler.config.force_disable_caches)))
        return compiled

    @contextlib.contextmanager
    def _tell_followers_if_refused(self, index: int) -> Iterator[Callable[[], bool]]:
        """On the leader, while it compiles graph ``index``: as soon as AOT autograd's cache refuses the graph
        (early, when it computes the key), mark it ``unshared``, so that the followers compile it now instead of
        waiting for the whole compile to find nothing in the cache. Yields whether the cache refused it."""
        before = autograd_cache_bypasses()
        refused = lambda: autograd_cache_bypasses() > before  # noqa: E731
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05) and not refused():
                pass
            if refused():
                self._mark(index, "unshared")

        watcher = threading.Thread(target=watch, daemon=True, name="compile-once-watch") if self.leads else None
        if watcher:
            watcher.start()
        try:
            yield refused
        finally:
            if watcher:
                stop.set()
                watcher.join()  # its marker, if any, is written before the leader's "done"

    def _marker(self, index: int, what: str) -> Path:
        return self.folder / f"leader{self.leader}" / f"{index}.{what}"

    def _mark(self, index: int, what: str, **content: Any) -> None:
        path = self._marker(index, what)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"rank": self.rank, "time": time.time(), **content}))
        partial.replace(path)
        os.utime(self.folder)  # the launch is alive: _remove_stale keeps it

    def _wait_for_leader(self, index: int, digest: str) -> tuple[float, bool, bool]:
        """Wait for the leader's graph ``index``: its announcement, then, if it is this graph, its compile, or
        word that torch's cache refused it. Returns the seconds waited, whether the graphs are the same, and
        whether the leader's cache refused the graph."""
        start = time.perf_counter()
        announced, done = self._marker(index, "start"), self._marker(index, "done")
        unshared = self._marker(index, "unshared")
        while not announced.exists():
            if time.perf_counter() - start > self.start_grace_seconds:
                logger.warning("compile once: rank %d has no graph %d after %.0f s; rank %d compiles its own",
                               self.leader, index, self.start_grace_seconds, self.rank)
                return time.perf_counter() - start, False, False
            time.sleep(0.05)
        if json.loads(announced.read_text()).get("digest") != digest:
            return time.perf_counter() - start, False, False
        next_note = 60.0
        while not done.exists() and not unshared.exists():
            waited = time.perf_counter() - start
            if waited > self.max_wait_seconds:
                logger.warning("compile once: rank %d still compiles graph %d after %.0f s; rank %d compiles it too",
                               self.leader, index, waited, self.rank)
                break
            if waited > next_note:
                logger.info("compile once: rank %d waits for rank %d to compile graph %d (%.0f s)",
                            self.rank, self.leader, index, waited)
                next_note += 60.0
            time.sleep(0.05)
        return time.perf_counter() - start, True, unshared.exists()


def graph_digest(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """What a Dynamo graph is made of, for telling a leader's graph from a follower's: its code and its inputs'
    kinds, shapes, dtypes, devices and (DTensors) placements."""
    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            placements = getattr(value, "placements", None)
            return f"{type(value).__name__}{tuple(value.shape)}{value.dtype}{value.device.type}{placements}"
        return repr(value)

    text = graph.code + "\n" + "\n".join(describe(value) for value in example_inputs)
    return hashlib.sha256(text.encode()).hexdigest()


class CompileOnceBackend:
    """A ``torch.compile`` backend: Inductor with ``options`` (what ``backend="inductor", options=...`` runs),
    each graph compiled through the session. Equal options give equal backends, so Dynamo reuses one module's
    compiled code for another of the same class (regional compilation), as it does for the string backend."""

    compiler_name = "inductor"

    def __init__(self, session: CompileOnce, options: dict[str, Any]) -> None:
        self.session = session
        self.options = dict(options)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        digest = graph_digest(graph, example_inputs)
        return self.session.compile(digest, lambda: compile_graph_with_inductor(graph, example_inputs, self.options))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CompileOnceBackend) and other.session is self.session
                and other.options == self.options)

    def __hash__(self) -> int:
        return hash((id(self.session), tuple(sorted(self.options))))


_SESSION: CompileOnce | None = None


def active_session() -> CompileOnce | None:
    """The session ``start_compile_once`` started in this process, if any."""
    return _SESSION


def graph_class(mesh: DeviceMesh | None) -> tuple[Any, ...]:
    """What decides whether two ranks can share compiled graphs: the pipeline stage and the process group names
    of every other mesh dimension (see the module's docstring)."""
    if mesh is None:
        return ()
    names = list(mesh.mesh_dim_names or ())
    flattened = ["dp"] if "dp_replicate" in names and "dp_shard" in names else []
    stage = mesh["pp"].get_local_rank() if "pp" in names else 0
    return (stage, *((name, mesh[name].get_group().group_name) for name in [*names, *flattened] if name != "pp"))


def start_compile_once(cache_folder: str, mesh: DeviceMesh | None, device: torch.device) -> CompileOnce | None:
    """Every rank calls it before a run's first compile (collectives on the default group). Rank 0 names this
    session's marker folder under ``cache_folder``; the ranks learn their classes and leaders. Returns the
    session (also kept for ``active_session``), or None where this rank cannot load another's graphs: it cannot
    see the folder (a cache folder not shared between nodes), its leader cannot, torch's caches are forced off,
    or the ranks run on different device indices (``cuda:r``), which torch's cache keys tell apart. Such a rank
    compiles its own graphs, as without compile once, and one warning says why."""
    global _SESSION
    rank = dist.get_rank()
    root = Path(cache_folder) / MARKERS
    token = [None]
    if rank == 0:
        _remove_stale(root)
        token[0] = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        (root / token[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(token, src=0)
    folder = root / token[0]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (graph_class(mesh), str(device), _why_not(folder)))
    classes, devices, reasons = zip(*everyone, strict=True)
    leader = classes.index(classes[rank])  # the lowest rank of this rank's class
    why = reasons[rank] or reasons[leader]
    if len(set(devices)) > 1:
        why = (f"the ranks run on different devices ({', '.join(sorted(set(devices))[:3])}, ...), which torch's "
               "compile cache keys tell apart. Give each process one GPU as cuda:0 (CUDA_VISIBLE_DEVICES per rank)")
    _SESSION = None
    if why is None:
        _SESSION = CompileOnce(rank=rank, leader=leader, folder=folder, cache_folder=cache_folder)
    elif rank == 0 or reasons[rank]:
        logger.warning("compile once: off for rank %d, %s: it compiles its own graphs", rank, why)
    return _SESSION


def _why_not(folder: Path) -> str | None:
    """Why this rank cannot load graphs another rank compiles into ``folder``, or None."""
    if forced_off := compile_caches_forced_off():
        return f"{' and '.join(forced_off)} keeps torch's compile caches off (unset it to compile once)"
    if not folder.is_dir():
        return (f"it cannot see {folder} (the compile cache folder is not shared with rank 0; set [compile] "
                "cache_dir to a folder every node reads)")
    return None


@contextlib.contextmanager
def use_session(session: CompileOnce) -> Iterator[CompileOnce]:
    """Make ``session`` this process's session while the block runs (the precompile's, which leads itself)."""
    global _SESSION
    session.pinned = True
    previous, _SESSION = _SESSION, session
    try:
        yield session
    finally:
        _SESSION = previous


def _remove_stale(root: Path) -> None:
    if not root.is_dir():
        return
    for old in root.iterdir():
        try:
            if time.time() - old.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def describe_compile_once(session: CompileOnce | None) -> str:
    """One line for the job, gathered from every rank (every rank calls it, with its session or None): who
    compiled, who loaded, from where, and the compile seconds summed over ranks."""
    mine: dict[str, Any] = {"rank": dist.get_rank(), "leader": None}
    if session is not None:
        records = session.records
        mine.update(leader=session.leader, graphs=len(records), hits=sum(r.hits for r in records),
                    compiled=sum(r.compiled for r in records), seconds=sum(r.seconds for r in records),
                    waited=sum(r.waited for r in records), folder=session.cache_folder,
                    differ=sum(not r.same_as_leader for r in records),
                    unshared=sum(r.unshared for r in records), uncached=any(r.uncached for r in records))
    everyone: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    parts = [_describe_class(everyone, leader) for leader in sorted({r["leader"] for r in everyone} - {None})]
    alone = [r["rank"] for r in everyone if r["leader"] is None]
    if alone:
        parts.append(f"rank(s) {_ranks(alone)} compiled alone")
    folder = next((r["folder"] for r in everyone if r.get("folder")), "off")
    total = sum(r.get("seconds", 0.0) for r in everyone)
    return f"compile once ({folder}): " + "; ".join(parts) + f"; {total:.1f} s compiling over the ranks with it"


def _describe_class(everyone: list[dict[str, Any]], leader: int) -> str:
    lead = everyone[leader]
    what = ("compiled every graph without torch's compile caches" if lead["uncached"] else
            f"compiled {lead['compiled']} and loaded {lead['hits']} FX graphs")
    text = f"rank {leader} {what} ({lead['graphs']} Dynamo graphs, {lead['seconds']:.1f} s)"
    followers = [r for r in everyone if r["leader"] == leader and r["rank"] != leader]
    if followers:
        text += (f"; rank(s) {_ranks([r['rank'] for r in followers])} loaded {sum(r['hits'] for r in followers)} "
                 f"and compiled {sum(r['compiled'] for r in followers)} "
                 f"({max(r['seconds'] for r in followers):.1f} s at most, after waiting "
                 f"{max(r['waited'] for r in followers):.1f} s)")
        if differ := sum(r["differ"] for r in followers):
            text += f", {differ} graph(s) differing from rank {leader}'s"
    if lead["unshared"]:
        text += (f"; {lead['unshared']} Dynamo graph(s) compiled by every rank: AOT autograd's cache refused them "
                 "(a traced autograd.Function)")
    return text


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ",".join(map(str, ranks))
