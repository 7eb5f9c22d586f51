"""SimpleFSDP: fully sharded data parallel out of DTensor, a parametrization and selective checkpointing.

(Zhang et al., "SimpleFSDP: Simpler Fully Sharded Data Parallel with torch.compile", arXiv 2411.00284.)

1. **Storage.** ``data_parallel`` replaces every parameter by ``nn.Parameter(DTensor)`` on the data-parallel
   mesh: ``Shard(0)`` (fully_shard), ``Replicate()`` (replicate, i.e. DDP) or ``(Replicate(), Shard(0))``
   on a ``(dp_replicate, dp_shard)`` mesh (hybrid_shard). The optimizer, gradient clipping and
   ``state_dict()`` see only these sharded DTensors, under their original names.
2. **Use.** Each parameter-owning module's class is swapped for a subclass in which ``weight`` (etc.) is a
   property: reading it inside forward casts the local shard to ``param_dtype`` and redistributes it to
   ``Replicate()`` (an all-gather; nothing for replicate), then hands the module a plain tensor whose
   gradient is declared ``Partial("sum")``. Autograd therefore runs the backward of that redistribute as a
   reduce-scatter (fully_shard), an all-reduce (replicate) or both (hybrid_shard), in ``reduce_dtype``,
   and casts the result back to the parameter's dtype. No hooks, streams or custom autograd functions.
3. **Resharding.** With ``reshard_after_forward=True`` each block runs under selective activation
   checkpointing whose policy recomputes the all-gather (and its cast and views) in backward, so the
   unsharded weights die after forward (``activation_checkpoint.reshard_policy``). The checkpoint must
   enclose the modules that *consume* the weights: a ``Linear`` saves its weight for backward.

Everything is ordinary tensor code, so ``torch.compile(fullgraph=True)`` traces the collectives with the
model and Inductor can bucket and reorder them.

Gradients are summed across data-parallel ranks (``Partial("sum")``): the trainer divides the loss by the
global token count, so the sum is exactly the single-process gradient.

Composition with tensor parallel: a parameter that is already a DTensor (on a TP mesh cut from the same
root mesh) is rebuilt on the joint ``(dp..., tp...)`` mesh with the data-parallel placements first and its
TP placements after; the all-gather runs over the dp dimensions only and the module receives a DTensor on
the TP mesh again. When both shard dim 0, the dp placement becomes ``_StridedShard(0, split_factor=tp)``:
DTensor's ``Shard(0)`` on the dp dimension would mean "split by dp first", but the TP shard was cut first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from titan_simple.parallel.activation_checkpoint import apply_checkpoint, reshard_policy
from titan_simple.parallel.torch_private import StridedShard, root_mesh

MODES = ("fully_shard", "replicate", "hybrid_shard")
_DP_PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "fully_shard": (Shard(0),),
    "replicate": (Replicate(),),
    "hybrid_shard": (Replicate(), Shard(0)),
}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered weights the forward computes with (all-gathers run in it).
    ``reduce_dtype``: dtype the gradient reduction runs in. ``None`` = the stored parameter's dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class _GatherSpec:
    """How one parameter becomes usable: the number of leading dp mesh dims to gather over, and the TP
    mesh/placements the module gets back (``tp_mesh is None``: a plain tensor)."""

    dp_dims: int
    mp_policy: MixedPrecisionPolicy
    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None = None
    tp_placements: tuple[Placement, ...] = ()
    float8: object | None = None  # a float8_gather.Float8Gather: a tensorwise float8 weight gathered in float8


def _gather(module: nn.Module, name: str) -> torch.Tensor:
    """The unsharded parameter for compute; its backward reduces the gradient over the dp dims."""
    param, spec = module._parameters[name], module._gather_specs[name]
    return _for_compute(_unshard(module, name), param, spec)


def _unshard(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter all-gathered over the dp dims, as a local tensor (this rank's TP shard under tensor
    parallel); its backward reduces the gradient over the dp dims."""
    param, spec = module._parameters[name], module._gather_specs[name]
    if spec.float8 is not None:  # this step's float8 bits of the shard, gathered (float8_gather.py)
        return spec.float8.unshard(module, param)
    dp = spec.dp_dims
    unsharded = param.redistribute(
        placements=(Replicate(),) * dp + spec.tp_placements,
        forward_dtype=spec.mp_policy.param_dtype,  # cast first: the all-gather runs in param_dtype
        backward_dtype=spec.mp_policy.reduce_dtype,  # the reduce-scatter / all-reduce runs in reduce_dtype
    )
    return unsharded.to_local(grad_placements=(Partial("sum"),) * dp + spec.tp_placements)


def chunk_rows(size: int, n: int) -> list[int]:
    """Rows per rank of ``torch.chunk(size, n)`` (how DTensor splits ``Shard(0)``), 0 for ranks left empty."""
    step = -(-size // n)
    return [max(0, min(step, size - r * step)) for r in range(n)]


def unsharded_local_shape(param: DTensor, spec: _GatherSpec) -> tuple[int, ...]:
    """The parameter's shape once gathered over dp: its global shape, cut by its tensor-parallel shards."""
    shape = list(param.shape)
    if spec.tp_mesh is not None:
        for mesh_dim, placement in enumerate(spec.tp_placements):
            if placement.is_shard():
                size, coordinate = spec.tp_mesh.size(mesh_dim), spec.tp_mesh.get_local_rank(mesh_dim)
                shape[placement.dim] = chunk_rows(shape[placement.dim], size)[coordinate]
    return tuple(shape)


def data_parallel_group_names(model: nn.Module) -> set[str]:
    """The names of the process groups ``model``'s SimpleFSDP parameters are gathered and reduced over (what a
    compiled graph's data-parallel collectives name as their group)."""
    return {spec.dp_mesh.get_group(dim).group_name for module in model.modules()
            for spec in getattr(module, "_gather_specs", {}).values() for dim in range(spec.dp_mesh.ndim)}


def gather_unsharded(module: nn.Module) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """``module``'s parameters all-gathered now, in the form ``module._held_unsharded`` takes (dp-unsharded local
    tensors in ``param_dtype`` whose backward reduces the gradient; a float8-gathered weight as its two plain
    tensors, ``Float8Gather.gather``): for a caller that gathers them ahead of the forward that uses them (regional
    compilation's hand-off, ``regions.py``)."""
    def gathered(name: str):
        spec = module._gather_specs[name]
        if spec.float8 is not None:
            return spec.float8.gather(module, module._parameters[name])
        return _unshard(module, name)

    return {name: gathered(name) for name in module._gather_specs}


def _for_compute(local: torch.Tensor, param: DTensor, spec: _GatherSpec) -> torch.Tensor:
    """What the module computes with, from the dp-unsharded local tensor: itself, or under tensor parallel a
    DTensor on the TP mesh."""
    if spec.tp_mesh is None:
        return local
    return DTensor.from_local(
        local, spec.tp_mesh, spec.tp_placements, run_check=False, shape=param.shape, stride=param.stride()
    )


_GATHER_ENABLED = True


@contextlib.contextmanager
def sharded_parameters() -> Iterator[None]:
    """Inside, ``module.weight`` returns the stored sharded DTensor parameter instead of gathering it.

    Use it for anything that reads or writes parameters through module attributes outside forward:
    ``model.init_weights()`` after ``to_empty`` (so the init writes straight into the local shards),
    ``load_state_dict(..., assign=True)``, printing a weight. Outside, such a read is an all-gather that
    every rank must make, or the others hang.
    """
    global _GATHER_ENABLED
    previous, _GATHER_ENABLED = _GATHER_ENABLED, False
    try:
        yield
    finally:
        _GATHER_ENABLED = previous


def _gathered_property(name: str) -> property:
    def get(self) -> torch.Tensor | None:
        param = self._parameters[name]
        if param is None or not _GATHER_ENABLED:
            return param
        if self._held_unsharded is not None:  # gathered ahead: once per step (fsdp_gather.py), or by the
            # region before (regional compilation's hand-off, regions.py)
            held, spec = self._held_unsharded[name], self._gather_specs[name]
            if isinstance(held, tuple):  # a float8 weight handed over as its plain parts (float8_gather.py)
                held = spec.float8.assemble(self, *held)
            return _for_compute(held, param, spec)
        return _gather(self, name)

    return property(get, doc=f"``{name}``, all-gathered for compute (see simple_fsdp).")


_PARAMETRIZED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _parametrize(module: nn.Module, specs: dict[str, _GatherSpec]) -> None:
    """Swap ``module``'s class for a subclass whose parameter names are gathering properties. The
    DTensors stay in ``module._parameters``, so ``named_parameters()`` and ``state_dict()`` are unchanged."""
    key = (type(module), tuple(sorted(specs)))
    if key not in _PARAMETRIZED_CLASSES:
        attrs: dict = {name: _gathered_property(name) for name in key[1]}
        # {name: unsharded local tensor} while fsdp_gather.py or a regional hand-off holds them
        attrs["_held_unsharded"] = None
        _PARAMETRIZED_CLASSES[key] = type(type(module).__name__, (type(module),), attrs)
    module._gather_specs = specs
    module.__class__ = _PARAMETRIZED_CLASSES[key]


def _joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh, cut from the world mesh the dp mesh was sliced from (``_get_root_mesh`` is
    private). The TP mesh is matched by its dimension name and ranks, not by its root's identity: torch 2.13
    caches mesh slices, so after another world mesh was built in the same process (tests running several
    layouts) ``world['tp']`` may report that other world as its root."""
    root = root_mesh(dp_mesh)
    names = tp_mesh.mesh_dim_names or ()
    matches = (
        bool(dp_mesh.mesh_dim_names)
        and bool(names)
        and all(name in (root.mesh_dim_names or ()) for name in names)
        and torch.equal(root[names].mesh, tp_mesh.mesh)
    )
    if not matches:
        raise ValueError(
            "data_parallel: a DTensor parameter's mesh and the data-parallel mesh must be named slices of "
            f"the same world mesh, e.g. world['dp_shard'] and world['tp'] (got {dp_mesh.mesh_dim_names} of "
            f"{root.mesh_dim_names} and {names} of {root_mesh(tp_mesh).mesh_dim_names})."
        )
    return root[dp_mesh.mesh_dim_names + names]


def _shard(param: torch.Tensor, mesh: DeviceMesh, dp_placements: tuple[Placement, ...], mp_policy):
    """The sharded DTensor that replaces ``param`` and the spec to gather it back. Every rank must hold the
    same values (same seed, or the meta device): each keeps its slice, nothing is communicated."""
    spec = _GatherSpec(dp_dims=mesh.ndim, mp_policy=mp_policy, dp_mesh=mesh)
    if not isinstance(param, DTensor):
        return distribute_tensor(param.detach(), mesh, dp_placements, src_data_rank=None), spec
    # Tensor parallel (a 1-D TP mesh): dp placements first, then the TP ones, on the joint mesh.
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    tp_sharded_dims = {p.dim for p in tp_placements if isinstance(p, Shard)}
    placements = (
        tuple(
            StridedShard(p.dim, split_factor=tp_mesh.size())
            if isinstance(p, Shard) and p.dim in tp_sharded_dims
            else p
            for p in dp_placements
        )
        + tp_placements
    )
    # This rank's TP shard, sliced further for its dp coordinates.
    local = distribute_tensor(param.to_local().detach(), mesh, dp_placements, src_data_rank=None).to_local()
    sharded = DTensor.from_local(
        local, _joint_mesh(mesh, tp_mesh), placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return sharded, _GatherSpec(mesh.ndim, mp_policy, mesh, tp_mesh, tp_placements)


def default_reshard_modules(model: nn.Module) -> list[nn.Module]:
    """The checkpoint regions for resharding: every block of ``model.layers`` (a ModuleList/ModuleDict),
    plus every other direct child that owns parameters (embedding, final norm, output projection)."""
    layers = getattr(model, "layers", None)
    modules = list(layers.children()) if isinstance(layers, nn.Module) else []
    for child in model.children():
        if child is not layers and any(True for _ in child.parameters()):
            modules.append(child)
    return modules


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: str = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    reshard_modules: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Make ``model`` data parallel over ``mesh`` in place (and return it).

    ``mesh``: 1-D for ``fully_shard`` / ``replicate``, 2-D ``(dp_replicate, dp_shard)`` for
    ``hybrid_shard``. ``model`` may live on the meta device: then ``model.to_empty(device=...)`` and run
    its init under ``sharded_parameters()``. ``reshard_after_forward=False`` keeps the gathered weights from
    forward to backward (ZeRO-2 style: more memory, half the all-gathers). ``reshard_modules``: the
    checkpoint regions that free them, each enclosing the modules that use the weights (default:
    ``default_reshard_modules(model)``). Parameters owned by no region stay gathered until backward.
    """
    if mode not in MODES:
        raise ValueError(f"data_parallel: mode must be one of {MODES}, got {mode!r}.")
    dp_placements = _DP_PLACEMENTS[mode]
    if mesh.ndim != len(dp_placements):
        raise ValueError(
            f"data_parallel: mode {mode!r} needs a {len(dp_placements)}-D mesh "
            f"({'(dp_replicate, dp_shard)' if mode == 'hybrid_shard' else 'dp'}), got a {mesh.ndim}-D one."
        )
    mp_policy = mp_policy or MixedPrecisionPolicy()
    converted: dict[int, tuple[nn.Parameter, _GatherSpec]] = {}  # a shared (tied) parameter stays shared
    for module in list(model.modules()):
        specs = {}
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in converted:
                sharded, spec = _shard(param, mesh, dp_placements, mp_policy)
                converted[id(param)] = (nn.Parameter(sharded, requires_grad=param.requires_grad), spec)
            module._parameters[name], specs[name] = converted[id(param)]
        if specs:
            _parametrize(module, specs)

    # replicate: the stored parameter already is the unsharded weight, there is nothing to free.
    if reshard_after_forward and mode != "replicate":
        modules = default_reshard_modules(model) if reshard_modules is None else list(reshard_modules)
        group_names = [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]
        apply_checkpoint(modules, reshard_policy(group_names))
    return model
