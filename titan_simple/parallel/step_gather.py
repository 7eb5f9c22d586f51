"""SimpleFSDP, gathering once per step: for pipeline parallel and gradient accumulation.

SimpleFSDP gathers a weight where the forward reads it (``simple_fsdp.py``), so a step of ``m`` microbatches
(pipeline microbatches, or gradient-accumulation steps) all-gathers every weight ``m`` times (``2 m`` when
resharding after forward) and reduce-scatters every gradient ``m`` times. ``StepGather`` trades memory for
that traffic, as FSDP2's ``set_requires_gradient_sync(False)`` + ``reshard_after_backward=False`` and
MaxText's ``pipeline_fsdp_ag_once`` do:

    gather = StepGather(parts)      # the SimpleFSDP-wrapped model, or this rank's pipeline stages
    gather.gather()                 # one all-gather per bucket: the unsharded weights are held
    ...forward + backward of every microbatch...   # the modules read the held weights; no collectives
    gather.reduce()                 # one reduce-scatter per bucket into each parameter's sharded ``.grad``

**Held weights.** ``gather`` sets ``module._held_unsharded = {name: tensor}`` on every parametrized module;
SimpleFSDP's property then returns that tensor (a leaf that requires grad, in ``param_dtype``) instead of
gathering. Autograd sums the microbatches' gradients into it; with ``param_dtype != reduce_dtype`` a
post-accumulate hook moves each microbatch's gradient into a ``reduce_dtype`` buffer (bf16 would lose low bits
summing many microbatches), the same precision the per-microbatch reduce-scatters have.

**Buckets** are SimpleFSDP's reshard regions (``default_reshard_modules``: each transformer block, the
embedding, the norm, the output): the local shards of a bucket are padded to equal per-rank sizes, flattened
into one buffer and gathered by one DTensor redistribute (``Shard(0) -> Replicate()`` over the dp mesh); the
gradients go back the same way (``Partial() -> Shard(0)``: a reduce-scatter, plus an all-reduce over
``dp_replicate`` for hybrid_shard; ``Partial() -> Replicate()``, an all-reduce, for replicate). Only public
DTensor calls on plain tensors, so the traffic is counted and traced like SimpleFSDP's own.

Memory: per rank, the unsharded weights of its model part (``param_dtype``) and their gradients (``reduce_dtype``)
live from ``gather`` to ``reduce``. Under pipeline parallel that is a stage (1/pp of the model, 1/tp of it
under tensor parallel); without pipeline parallel the whole model, which is what FSDP exists to avoid, hence
``[parallelism] fsdp_gather = "auto"`` chooses it only under pipeline parallel (``train/plan.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_simple.parallel.simple_fsdp import _GatherSpec, default_reshard_modules
from titan_simple.parallel.torch_private import StridedShard


@dataclass
class _Entry:
    """One parameter of a bucket: where its shard goes in the bucket's flat buffer."""

    module: nn.Module
    name: str
    param: nn.Parameter
    spec: _GatherSpec
    shape: tuple[int, ...]  # the dp-unsharded local shape (the full shape; the TP shard under tensor parallel)
    rows: list[int]  # dim-0 rows each shard rank holds (torch.chunk's split, as DTensor's Shard(0))
    width: int = 0  # elements per rank in the flat buffer: the largest shard, so every rank's is equal
    offset: int = 0

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


@dataclass
class _Bucket:
    entries: list[_Entry] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(e.width for e in self.entries)


def _dp_layout(param: DTensor, spec: _GatherSpec) -> tuple[int | None, int, int]:
    """(the dp mesh dim the parameter is sharded over or None, its size, this rank's coordinate on it)."""
    # _StridedShard (dp and TP both cutting dim 0) is not a Shard in torch 2.13, but shards dim 0 all the same.
    dims = [i for i, p in enumerate(param.placements[: spec.dp_dims]) if p.is_shard() or isinstance(p, StridedShard)]
    if not dims:
        return None, 1, 0
    if len(dims) != 1 or param.placements[dims[0]].dim != 0:
        raise ValueError(f"step_gather: expects dim-0 sharding over one dp mesh dim, got {param.placements}")
    return dims[0], spec.dp_mesh.size(dims[0]), spec.dp_mesh.get_local_rank(dims[0])


def _chunk_rows(size: int, n: int) -> list[int]:
    """Rows per rank of ``torch.chunk(size, n)`` (how DTensor splits ``Shard(0)``), 0 for ranks left empty."""
    step = -(-size // n)
    return [max(0, min(step, size - r * step)) for r in range(n)]


def _unsharded_local_shape(param: DTensor, spec: _GatherSpec) -> tuple[int, ...]:
    """The parameter's shape once gathered over dp: its global shape, cut by its tensor-parallel shards."""
    shape = list(param.shape)
    if spec.tp_mesh is not None:
        for mesh_dim, placement in enumerate(spec.tp_placements):
            if placement.is_shard():
                size, coordinate = spec.tp_mesh.size(mesh_dim), spec.tp_mesh.get_local_rank(mesh_dim)
                shape[placement.dim] = _chunk_rows(shape[placement.dim], size)[coordinate]
    return tuple(shape)


class StepGather:
    """Hold the unsharded weights of ``parts`` (SimpleFSDP-wrapped modules) for a whole step; see the module
    docstring. ``gather()`` and ``reduce()`` are collectives: every rank of the dp mesh calls them."""

    def __init__(self, parts: Iterable[nn.Module]) -> None:
        self.buckets: list[_Bucket] = []
        self._groups: list[tuple] = []  # per bucket: (dp mesh, shard dim, n, coordinate)
        seen: set[int] = set()
        for part in parts:
            regions = default_reshard_modules(part)
            owned = {id(m) for region in regions for m in region.modules()}
            leftovers = [m for m in part.modules() if id(m) not in owned]
            for modules in [list(region.modules()) for region in regions] + [leftovers]:
                self._add_bucket(modules, seen)
        self._held: list[_Entry] = []
        self._accumulated: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def _add_bucket(self, modules: list[nn.Module], seen: set[int]) -> None:
        entries, group = [], None
        for module in modules:
            for name, spec in getattr(module, "_gather_specs", {}).items():
                param = module._parameters[name]
                if param is None:
                    continue
                shard_dim, n, coordinate = _dp_layout(param, spec)
                layout = (spec.dp_mesh, shard_dim, n, coordinate)
                if group is not None and layout[:3] != group[:3]:
                    raise ValueError("step_gather: a bucket's parameters must share their data-parallel layout: "
                                     f"{layout} vs {group}")
                group = layout
                shape = _unsharded_local_shape(param, spec)
                entry = _Entry(module, name, param, spec, shape, _chunk_rows(shape[0], n))
                if id(param) in seen:  # a tied weight: gathered once, read by both modules
                    entry.width = -1
                seen.add(id(param))
                entries.append(entry)
        if not entries:
            return
        offset = 0
        for entry in entries:
            if entry.width == -1:
                continue
            entry.width, entry.offset = max(entry.rows) * entry.row_numel, offset
            offset += entry.width
        self.buckets.append(_Bucket(entries))
        self._groups.append(group)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    # ------------------------------------------------------------------------------------------ gather

    @torch.no_grad()
    def gather(self) -> None:
        """One all-gather per bucket; every parametrized module then computes with the held weights."""
        if self._held:
            raise RuntimeError("StepGather.gather: already holding the weights; call reduce() first")
        held: dict[int, torch.Tensor] = {}
        for bucket, (mesh, shard_dim, n, _) in zip(self.buckets, self._groups, strict=True):
            owners = [e for e in bucket.entries if e.width != -1]
            dtype = owners[0].spec.mp_policy.param_dtype or owners[0].param.dtype
            locals_ = [e.param.to_local().to(dtype) for e in owners]
            if shard_dim is None:  # replicate: the local tensor is the whole weight
                fulls = locals_
            else:
                flat = torch.cat([F.pad(t.flatten(), (0, e.width - t.numel()))
                                  for t, e in zip(locals_, owners, strict=True)])
                placements = [Replicate()] * mesh.ndim
                sharded = list(placements)
                sharded[shard_dim] = Shard(0)
                gathered = DTensor.from_local(flat, mesh, sharded, run_check=False)
                rows = gathered.redistribute(mesh, placements).to_local().view(n, bucket.numel)
                fulls = []
                for e in owners:
                    width = e.row_numel
                    pieces = [rows[r, e.offset: e.offset + e.rows[r] * width] for r in range(n)]
                    fulls.append(torch.cat(pieces).view(e.shape))
            for e, full in zip(owners, fulls, strict=True):
                leaf = full.detach().requires_grad_(e.param.requires_grad)
                held[id(e.param)] = leaf
                reduce_dtype = e.spec.mp_policy.reduce_dtype or e.param.dtype
                if leaf.requires_grad and reduce_dtype != leaf.dtype:
                    self._hooks.append(leaf.register_post_accumulate_grad_hook(self._accumulate(reduce_dtype)))
        for bucket in self.buckets:
            for e in bucket.entries:
                if e.module._held_unsharded is None:
                    e.module._held_unsharded = {}
                e.module._held_unsharded[e.name] = held[id(e.param)]
                self._held.append(e)

    def _accumulate(self, dtype: torch.dtype):
        def hook(leaf: torch.Tensor) -> None:
            total = self._accumulated.get(id(leaf))
            self._accumulated[id(leaf)] = leaf.grad.to(dtype) if total is None else total.add_(leaf.grad)
            leaf.grad = None

        return hook

    # ------------------------------------------------------------------------------------------ reduce

    @torch.no_grad()
    def reduce(self) -> None:
        """One reduce-scatter (all-reduce for replicate) per bucket of the held weights' gradients, summed over
        the dp ranks, into each parameter's sharded ``.grad`` (added to it if one exists); then drop the held
        weights."""
        if not self._held:
            raise RuntimeError("StepGather.reduce: nothing held; call gather() first")
        for bucket, (mesh, shard_dim, _, coordinate) in zip(self.buckets, self._groups, strict=True):
            owners = [e for e in bucket.entries if e.width != -1 and e.param.requires_grad]
            if not owners:
                continue
            grads = [self._gradient(e) for e in owners]
            used = [self._used(e) for e in owners]
            partial = [Partial()] * mesh.ndim
            if shard_dim is None:
                flat = torch.cat([g.flatten() for g in grads])
                reduced = DTensor.from_local(flat, mesh, partial, run_check=False)
                flat = reduced.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
                local_grads, start = [], 0
                for e in owners:
                    local_grads.append(flat[start: start + math.prod(e.shape)].view(e.shape))
                    start += math.prod(e.shape)
            else:
                columns = []
                for e, g in zip(owners, grads, strict=True):
                    pieces = g.flatten().split([r * e.row_numel for r in e.rows])
                    columns.append(torch.stack([F.pad(p, (0, e.width - p.numel())) for p in pieces]))
                target = [Replicate()] * mesh.ndim
                target[shard_dim] = Shard(0)
                buffer = DTensor.from_local(torch.cat(columns, dim=1).flatten(), mesh, partial, run_check=False)
                mine = buffer.redistribute(mesh, target).to_local()
                local_grads = [
                    mine[e.offset: e.offset + e.rows[coordinate] * e.row_numel].view(
                        e.rows[coordinate], *e.shape[1:])
                    for e in owners
                ]
            for e, local, was_used in zip(owners, local_grads, used, strict=True):
                if not was_used:  # no gradient, as autograd leaves a parameter the step did not use
                    continue
                grad = DTensor.from_local(local.to(e.param.dtype), e.param.device_mesh, e.param.placements,
                                          run_check=False, shape=e.param.shape, stride=e.param.stride())
                if e.param.grad is None:
                    e.param.grad = grad
                else:
                    e.param.grad.add_(grad)
        self.release()

    def _used(self, entry: _Entry) -> bool:
        leaf = entry.module._held_unsharded[entry.name]
        return id(leaf) in self._accumulated or leaf.grad is not None

    def _gradient(self, entry: _Entry) -> torch.Tensor:
        leaf = entry.module._held_unsharded[entry.name]
        reduce_dtype = entry.spec.mp_policy.reduce_dtype or entry.param.dtype
        grad = self._accumulated.get(id(leaf), leaf.grad)
        if grad is None:  # not used this step: zeros in the buffer, and no .grad is set (see reduce)
            return torch.zeros(entry.shape, dtype=reduce_dtype, device=leaf.device)
        return grad.to(reduce_dtype)

    def release(self) -> None:
        """Drop the held weights and gradients without reducing (after a failed step)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._accumulated.clear()
        for e in self._held:
            e.module._held_unsharded = None
        self._held.clear()
