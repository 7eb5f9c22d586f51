"""The private torch APIs of the parallelisms (``titan_simple.parallel``) and the trainer's process groups, all
imported here; other modules import them from this one. The compiler's private APIs (Inductor, AOT autograd,
Dynamo) are in ``compile/inductor_private.py``, so that an eager process never imports Inductor.

A private API may change in any torch release, with no deprecation. Each package layer that needs one has one
guarded module (this one, ``compile/inductor_private.py``, ``dry_run/torch_private.py``,
``trainer/torch_private.py``), checked with torch 2.13: ``tests/test_torch_private.py`` checks every entry of their
``PRIVATE_APIS`` (and ``LAZY_PRIVATE_APIS``), names any that is missing, and fails on a private torch import
anywhere else in the package.

A private name that is simply used as is gets re-exported here under a name without the underscore.
Where a private API is a method or a config key, a small function wraps it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import warnings

import torch
import torch._functorch.config as functorch_config
import torch.distributed._functional_collectives as functional_collectives
import torch.distributed._symmetric_memory as symmetric_memory
import torch.distributed.distributed_c10d as c10d
import torch.distributed.tensor._utils as dtensor_utils
import torch.distributed.tensor.placement_types as placement_types
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _python_dispatch

# --- re-exports: the names the rest of the package imports ------------------------------------------------
StridedShard = placement_types._StridedShard
TorchDispatchMode = _python_dispatch.TorchDispatchMode
# The functional collectives (traceable, named by their group): torch 2.13 names them *_single; torch 2.11, which
# our first GPU machine had, has only the older *_tensor names (2.13 keeps them, with a warning).
all_gather_single = (getattr(functional_collectives, "all_gather_single", None)
                     or functional_collectives.all_gather_tensor)
reduce_scatter_single = (getattr(functional_collectives, "reduce_scatter_single", None)
                         or functional_collectives.reduce_scatter_tensor)
all_reduce = functional_collectives.all_reduce
all_to_all_single = functional_collectives.all_to_all_single
wait_tensor = functional_collectives.wait_tensor

# (owner, attribute, why we need it). The guard test checks each one with hasattr on the owner.
PRIVATE_APIS: tuple[tuple[object, str, str], ...] = (
    (c10d, "_set_pg_timeout", "set_process_group_timeout (trainer/distributed.py): the training timeout"),
    (c10d, "ProcessGroupGloo", "use_one_gloo_worker_thread: the name gloo backends are built from"),
    (c10d, "_new_process_group_helper", "use_one_gloo_worker_thread: wrapped; builds every process group"),
    (torch.distributed.ProcessGroupGloo, "_Options", "use_one_gloo_worker_thread: gloo's options with threads"),
    *((torch.distributed.ProcessGroupGloo._Options, n, "use_one_gloo_worker_thread") for n in ("_threads", "_devices")),
    (c10d, "_get_default_group", "process_group_timeout_seconds: the default group, to read its timeout"),
    (c10d.ProcessGroup, "_get_backend", "process_group_timeout_seconds: the group's gloo / NCCL backend"),
    (c10d.ProcessGroupGloo._Options, "_timeout",
     "process_group_timeout_seconds: a backend's current timeout (Backend.Options._timeout, NCCL's too)"),
    (_python_dispatch, "TorchDispatchMode",
     "sharded_init.py: the dispatch mode behind layout-invariant random init"),
    (functorch_config, "donated_buffer",
     "pipeline.py: turned off for zero-bubble schedules, which run a compiled backward twice"),
    (DeviceMesh, "_flatten", "dims.py: the flattened 'dp' (replicate x shard) and 'dp_shard_cp' mesh dimensions"),
    (functional_collectives, "all_gather_single",
     "context_parallel.py, float8_gather.py: the keys' and values' all-gather (its backward a reduce-scatter); "
     "float8 weights' gathers"),
    (functional_collectives, "reduce_scatter_single", "float8_gather.py: float8 weights' gradients"),
    (functional_collectives, "all_reduce", "float8_gather.py: replicated gradients and the weights' amaxes"),
    (functional_collectives, "wait_tensor", "float8_gather.py, matrix_owners.py: a functional collective's result"),
    (functional_collectives, "all_to_all_single",
     "matrix_owners.py: Muon's blocks to their matrices' owners and back (traced by the dry run like the others)"),
    (DeviceMesh, "_get_root_mesh", "simple_fsdp.py: the world mesh a dp mesh was sliced from (dp x tp)"),
    (dtensor_utils, "_compute_local_shape_and_global_offset",
     "matrix_owners.py: the block of a sharded matrix each rank holds (strided shards under TP included)"),
    (placement_types, "_StridedShard",
     "simple_fsdp.py: the dp placement of a TP-sharded dim (the only spelling in torch 2.13)"),
    (symmetric_memory, "enable_symm_mem_for_group",
     "async tensor parallel (parallelize.py): the pass fuses only on groups registered here"),
    (symmetric_memory, "is_symm_mem_enabled_for_group",
     "async tensor parallel: what the pass checks before it fuses (tests)"),
    (symmetric_memory, "empty", "scripts/gpu_check.py: probe whether symmetric memory works on this node"),
    (symmetric_memory, "rendezvous", "scripts/gpu_check.py: probe whether symmetric memory works on this node"),
)


def local_shape_and_offset(param: torch.distributed.tensor.DTensor, coordinate: tuple[int, ...]
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block of a DTensor the rank at ``coordinate`` of its mesh holds: its local shape and where it starts in
    the global tensor, as DTensor itself lays its shards out (uneven and strided shards included)."""
    return dtensor_utils._compute_local_shape_and_global_offset(param.shape, param.device_mesh.shape,
                                                                list(coordinate), param.placements)


# Imported only when used: importing it registers the "fake" c10d backend. (module, attribute, why)
LAZY_PRIVATE_APIS: tuple[tuple[str, str, str], ...] = (
    ("torch.testing._internal.distributed.fake_pg", "FakeStore",
     "fake_process_group.py: one process acting as one rank of a large job (dry runs, precompiles)"),
)


def fake_store() -> object:
    """The store of torch's "fake" c10d backend, whose collectives return at once and move no data; importing its
    module (``torch.testing._internal``: the only place torch ships it) registers the backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def all_gather_with_reduce_scatter_backward(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` of every rank of the group concatenated along dim 0; backward, the gradient reduce-scattered (summed).
    The functional collective names its group by a string, a constant of the traced graph: the public
    ``DTensor.from_local(x, mesh, ...)`` inside a compiled region makes the mesh an opaque graph input whose cache
    key differs on every rank, so compile once could not share the graph (docs/parallelism.md, "Context parallel")."""
    return functional_collectives.all_gather_single(x, 0, group_name)


def no_donated_buffers() -> contextlib.AbstractContextManager:
    """A context manager that compiles backward graphs without donated buffers. A backward with donated
    buffers cannot run twice with ``retain_graph=True``."""
    return functorch_config.patch(donated_buffer=False)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Flatten ``mesh``'s dimensions into one dimension ``name`` of its root mesh (``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``DeviceMesh._get_root_mesh``)."""
    return mesh._get_root_mesh()


def enable_symmetric_memory(group_name: str) -> None:
    """Register ``group_name`` for symmetric memory. torch 2.13 marks ``enable_symm_mem_for_group`` deprecated
    ("no need to call"), yet its micro-pipelined TP pass still fuses only on groups it registered
    (``is_symm_mem_enabled_for_group``), so we call it and silence that one deprecation warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*enable_symm_mem_for_group.*", category=FutureWarning)
        symmetric_memory.enable_symm_mem_for_group(group_name)


def probe_symmetric_memory(group: torch.distributed.ProcessGroup, device: torch.device) -> None:
    """Allocate a small symmetric-memory buffer on ``device`` and rendezvous it over ``group`` (a collective: every
    rank of the group calls it): what async tensor parallel's fused kernels do first. Raises where this node cannot
    (no CUDA, no peer access between the GPUs, a driver or NCCL without support). Checked by reading torch 2.13's
    ``torch/distributed/_symmetric_memory/__init__.py``: ``empty(*size, dtype, device)`` allocates from the
    symmetric pool on CUDA, ``rendezvous(tensor, group)`` takes a ProcessGroup or its name; no GPU has run it."""
    buffer = symmetric_memory.empty(64, dtype=torch.uint8, device=device)
    symmetric_memory.rendezvous(buffer, group)


# --- process groups -------------------------------------------------------------------------------------------



def set_process_group_timeout(group: torch.distributed.ProcessGroup | None, seconds: float) -> None:
    """Change the timeout of ``group`` (None: the default group) for the collectives issued from now on. torch
    2.13 has no public API for it (``distributed_c10d._set_pg_timeout``: NCCL and gloo backends)."""
    c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


_TORCH_GLOO = torch.distributed.ProcessGroupGloo


class _OneWorkerThreadGloo(_TORCH_GLOO):
    """torch's gloo backend as its Python constructor builds it (init.cpp: a tcp device per GLOO_SOCKET_IFNAME
    interface, else the default one; lazy init read from the environment), with one worker thread, not 2 per device."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        options = _TORCH_GLOO._Options()
        options._timeout = timeout
        interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
        options._devices = ([_TORCH_GLOO.create_device(interface=name) for name in interfaces] if interfaces
                            else [_TORCH_GLOO.create_default_device()])
        options._threads = 1  # one thread serves every device's context: a second would race again
        super().__init__(store, rank, size, options)


def use_one_gloo_worker_thread() -> None:
    """Every gloo process group created from now on (default, ``new_group``, a DeviceMesh's) runs its collectives
    on one worker thread. torch 2.13's ``ProcessGroupGloo::runLoop`` writes each finished collective's name into a
    string its worker threads share, outside its lock: with torch's two threads, two all-gathers finishing together
    free one heap buffer twice, and a rank aborts, crashes or hangs later (evidence, repro and cost:
    docs/research/upstream_gloo_worker_thread_race.md). Only ``_Options._threads`` sets the count, and
    ``_new_process_group_helper`` builds gloo backends from the module-level name ``ProcessGroupGloo``: our class
    stands there only while it runs, so torch's ``isinstance`` checks on the backends it hands back
    (``_set_pg_timeout``'s) still hold."""
    create = c10d._new_process_group_helper
    if getattr(create, "one_gloo_worker_thread", False):
        return

    @functools.wraps(create)
    def create_with_one_gloo_worker_thread(*args, **kwargs):
        previous, c10d.ProcessGroupGloo = c10d.ProcessGroupGloo, _OneWorkerThreadGloo
        try:
            return create(*args, **kwargs)
        finally:
            c10d.ProcessGroupGloo = previous

    create_with_one_gloo_worker_thread.one_gloo_worker_thread = True
    c10d._new_process_group_helper = create_with_one_gloo_worker_thread


def process_group_timeout_seconds(group: torch.distributed.ProcessGroup | None = None) -> float:
    """The timeout ``group``'s backend applies now (None: the default group), for checks and logs (gloo:
    ``ProcessGroupGloo.options.timeout``; NCCL: the same option, ``ProcessGroupNCCL.options``)."""
    group = group or c10d._get_default_group()
    backend = group._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return backend.options._timeout.total_seconds()
