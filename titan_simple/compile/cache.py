"""Compiled artifacts kept for the next start: where they live, and what a start reused.

    folder = use_compile_cache(config_folder)      # before the first compile, once per process
    ...the first step compiles (or loads)...
    logger.info(describe_compile_cache(recorders)) # "compile cache: reused 2 of 2 graphs from ..." (after step 1)

torch.compile already caches what it compiled: Inductor's FX graph cache (the generated code of each graph),
AOTAutograd's cache (the forward/backward split, on top of it) and the kernels, all under
``TORCHINDUCTOR_CACHE_DIR``. A start whose graphs and settings are the same finds them there and skips AOT
autograd and Inductor (Dynamo still traces). Two things of ours had kept every graph out of those caches: the
post-grad pass had no ``uuid`` and the selective-checkpoint ``context_fn`` had no ``cache_hash``
(``compile._OverlapPass.uuid``, ``activation_checkpoint._context_fn``). Staleness is torch's to rule out: the
cache keys hold the traced graph, the Inductor settings (our pass's uuid: its settings and source), the
checkpoint policies' hash and the torch version, so anything that changes the graph misses.

What the cache cannot give back is what our pass records while it runs: the comm plan. Each recorder keeps a
copy of its plan under the cache folder, keyed by the run's compile fingerprint (``core/plan.py``: the model,
layout, shapes, dtypes, checkpointing, compile settings, torch version and this package's source) and the rank;
a start that loaded its graphs restores the plan from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from titan_simple.compile.cache_folder import CACHE_DIR_VARIABLE, check_cache_folder_writable
from titan_simple.compile.comm_plan import CommPlanRecorder
from titan_simple.compile.compile_plan import CPU_THREADS
from titan_simple.compile.inductor_private import (
    compile_counters,
    default_inductor_cache_dir,
    graph_cache_enabled,
    inductor_cache_dir,
)

logger = logging.getLogger(__name__)

def use_compile_cache(folder: str) -> str:
    """Point torch's compile caches at ``folder`` (``[compile] cache_dir``) for this process, unless the
    environment already names one (an explicit ``TORCHINDUCTOR_CACHE_DIR`` wins); return the folder in use.
    Must run before the first compile: torch reads the variable when it first needs the folder."""
    explicit = os.environ.get(CACHE_DIR_VARIABLE)
    # Importing Inductor sets the variable to torch's default when it is unset: that one is not the user's.
    if explicit and os.path.abspath(explicit) != os.path.abspath(default_inductor_cache_dir()):
        check_cache_folder_writable(explicit, f"{CACHE_DIR_VARIABLE} {explicit!r}")
        return os.path.abspath(explicit)
    check_cache_folder_writable(folder, f"[compile] cache_dir {folder!r}")
    os.environ[CACHE_DIR_VARIABLE] = os.path.abspath(folder)
    return os.environ[CACHE_DIR_VARIABLE]


def disable_compile_caches() -> None:
    """From now on this process compiles every graph afresh: torch's compile caches are neither read nor written
    (``torch.compiler.config.force_disable_caches``)."""
    torch.compiler.config.force_disable_caches = True


def comm_plan_store(fingerprint: str, pass_uuid: str, rank: int) -> Path:
    """Where a recorder keeps its copy of the comm plan for a later start with the same graphs."""
    key = hashlib.sha256(f"{fingerprint}:{pass_uuid}".encode()).hexdigest()[:24]
    return Path(inductor_cache_dir()) / "titan_simple_comm_plans" / f"{key}-rank{rank}.json"


def describe_compile_cache(recorders: Iterable[CommPlanRecorder]) -> str:
    """One line on what this start's compile reused, after the first step (every graph compiled or loaded by
    then); restores the comm plans of graphs that came from the cache."""
    counts = compile_counters()
    hits, misses, bypasses = counts["hit"], counts["miss"], counts["bypass"]
    restored = sum(recorder.restore() for recorder in recorders)
    folder = os.environ.get(CACHE_DIR_VARIABLE) or inductor_cache_dir()
    total = hits + misses + bypasses
    if total == 0:
        return ("compile cache: off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)" if not graph_cache_enabled()
                else "compile cache: no graph compiled")
    if hits == total:
        what = f"reused all {total} compiled graphs"
    elif hits:
        what = f"reused {hits} of {total} compiled graphs, compiled {misses + bypasses}"
    else:
        what = f"compiled {total} graphs"
    if bypasses:
        what += f" ({bypasses} not cacheable)"
    plans = "; comm plan restored from the cache" if restored else ""
    return f"compile cache: {what} ({folder}){plans}"


LAST_COMPILE = "titan_simple_last_compile.json"


def describe_recompile(folder: str, fingerprint: str, parts: Sequence[tuple[str, str]], write: bool) -> str | None:
    """Why this start's graphs will not come from ``folder``: the line to log once (None when the folder's last
    run had the same graphs, or none ran there). torch's cache keys decide what is reused; this names which part
    of our fingerprint changed since the last run that compiled into the folder (model, layout and recipe, loss,
    shapes, torch, this package's code). ``write``: record this run as the folder's last (one rank does)."""
    path = Path(folder) / LAST_COMPILE
    try:
        last = json.loads(path.read_text())
        before = dict(last.get("parts", []))
        changed = [_changed_part(name, before.get(name), digest) for name, digest in parts
                   if before.get(name) != digest]
        hint = ("; Inductor keys CPU kernels by the thread count: give the job and whatever compiled the folder "
                "the same OMP_NUM_THREADS (torchrun sets 1 when it starts several processes on a node)"
                if any(name.startswith(CPU_THREADS) for name in changed) else "")
        line = (None if last.get("fingerprint") == fingerprint else
                f"compile: the graphs compile again: {folder} last held another run's "
                f"({', '.join(changed) or 'settings'} changed){hint}")
    except FileNotFoundError:
        line = None
    except (OSError, ValueError, TypeError, AttributeError):
        line = f"compile: {path} is unreadable (ignored): the graphs compile unless torch's cache has them"
    if write and fingerprint:
        partial = path.with_name(f".{LAST_COMPILE}.{os.getpid()}")
        try:
            partial.write_text(json.dumps({"fingerprint": fingerprint, "parts": [list(p) for p in parts]}))
            partial.replace(path)  # atomic: a reader sees the old record or the new one
        except OSError:
            pass
    return line


def _changed_part(name: str, before: str | None, now: str) -> str:
    """A changed fingerprint part as the recompile line names it: the thread count with both numbers."""
    return f"{name} {before} -> {now}" if name == CPU_THREADS and before is not None else name
