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
``[parallelism] fsdp_gather = "auto"`` chooses it only under pipeline parallel (``core/plan.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_simple.parallel.float8_gather import BITS_BUFFER
from titan_simple.parallel.simple_fsdp import _GatherSpec, chunk_rows, default_reshard_modules, unsharded_local_shape
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
        raise ValueError(f"fsdp_gather: expects dim-0 sharding over one dp mesh dim, got {param.placements}")
    return dims[0], spec.dp_mesh.size(dims[0]), spec.dp_mesh.get_local_rank(dims[0])


def _to_gather(entry: _Entry) -> torch.Tensor:
    """What a parameter's shard is gathered as: this step's float8 bits (a float8-gathered weight,
    ``float8_gather.py``), or the shard in ``param_dtype``."""
    if entry.spec.float8 is not None:
        return entry.module._buffers[BITS_BUFFER]
    return entry.param.to_local().to(entry.spec.mp_policy.param_dtype or entry.param.dtype)


class StepGather:
    """Hold the unsharded weights of ``parts`` (SimpleFSDP-wrapped modules) for a whole step; see the module
    docstring. ``gather()`` and ``reduce()`` are collectives: every rank of the dp mesh calls them."""

    def __init__(self, parts: Iterable[nn.Module], lazy: bool = True) -> None:
        """``lazy``: wait for each bucket's gather where its weights are first read (eager forwards). A compiled
        forward must find the held weights ready (they are its graph's inputs): ``lazy=False`` waits for them
        all in ``gather()``."""
        self.lazy = lazy
        self.buckets: list[_Bucket] = []
        self._groups: list[tuple] = []  # per bucket: (dp mesh, shard dim, n, coordinate)
        self._aliases: list[_Entry] = []  # a tied parameter's second module: reads what its first bucket holds
        seen: set[int] = set()
        for part in parts:
            # In the order the forward first reads them (embedding, blocks, norm, output): the gathers complete
            # in the order they start, so the first forward waits only for what it reads first.
            position = {id(m): i for i, m in enumerate(part.modules())}
            regions = sorted(default_reshard_modules(part), key=lambda region: position[id(region)])
            owned = {id(m) for region in regions for m in region.modules()}
            leftovers = [m for m in part.modules() if id(m) not in owned]
            for modules in [list(region.modules()) for region in regions] + [leftovers]:
                self._add_bucket(modules, seen)
        self._held: list[_Entry] = []
        self._state: list[_HeldBucket] = []  # this step's buckets, in gather order
        self._accumulated: dict[int, torch.Tensor] = {}  # reduce-dtype sums of bf16 microbatch gradients
        self._passes: dict[int, int] = {}  # backward passes that reached each held weight this step
        self._expected: int | None = None
        self._pending: tuple | None = None  # the reduce-scatter in flight: (owners, local grads, used)
        self._hooks: list = []
        # phase_scope(name): a context around the once-per-step work that runs inside a microbatch (a bucket's
        # unpacking, "gather"; a reduce-scatter started in backward, "reduce"): the dry run's tracer counts it
        # once per step, not once per microbatch.
        self.phase_scope: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()

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
                    raise ValueError("fsdp_gather: a bucket's parameters must share their data-parallel layout: "
                                     f"{layout} vs {group}")
                group = layout
                shape = unsharded_local_shape(param, spec)
                entry = _Entry(module, name, param, spec, shape, chunk_rows(shape[0], n))
                if id(param) in seen:  # a tied weight: gathered once by its first bucket, read by both modules
                    self._aliases.append(entry)
                    continue
                seen.add(id(param))
                entries.append(entry)
        # Dtype-aware: float8-gathered weights (float8_gather.py) travel as bytes, in a bucket of their own.
        for part in ([e for e in entries if e.spec.float8 is None], [e for e in entries if e.spec.float8 is not None]):
            if part:
                offset = 0
                for entry in part:
                    entry.width, entry.offset = max(entry.rows) * entry.row_numel, offset
                    offset += entry.width
                self.buckets.append(_Bucket(part))
                self._groups.append(group)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    # ------------------------------------------------------------------------------------------ gather

    @torch.no_grad()
    def gather(self, microbatches: int | None = None) -> None:
        """Start one all-gather per bucket, all at once, in the order the forward reads them; every parametrized
        module then computes with the held weights. ``lazy``: a bucket's gather is waited for where its weights
        are first read (``_HeldBucket``), so the later buckets' gathers run while the first blocks compute.

        ``microbatches``: how many backward passes the step runs (accumulation x pipeline microbatches). Given,
        each bucket's reduce-scatter starts as soon as the last of them has completed the bucket's gradients,
        while the backward of the earlier layers goes on; ``reduce()`` then finishes what is left."""
        if self._held:
            raise RuntimeError("StepGather.gather: already holding the weights; call reduce() first")
        self._expected = microbatches
        for index, (bucket, (mesh, shard_dim, n, _)) in enumerate(zip(self.buckets, self._groups, strict=True)):
            owners = bucket.entries
            locals_ = [_to_gather(e) for e in owners]
            if shard_dim is None:  # replicate: the local tensor is the whole weight
                pending = locals_
            else:
                flat = torch.cat([F.pad(t.flatten(), (0, e.width - t.numel()))
                                  for t, e in zip(locals_, owners, strict=True)])
                placements = [Replicate()] * mesh.ndim
                sharded = list(placements)
                sharded[shard_dim] = Shard(0)
                gathered = DTensor.from_local(flat, mesh, sharded, run_check=False)
                pending = gathered.redistribute(mesh, placements, async_op=True).to_local()
            self._state.append(_HeldBucket(self, index, owners, pending, shard_dim, n))
        for e in [e for bucket in self.buckets for e in bucket.entries] + self._aliases:
            if e.module._held_unsharded is None:
                e.module._held_unsharded = _HeldWeights() if self.lazy else {}
            state = self._owner_state(e)
            if self.lazy:
                e.module._held_unsharded.entries[e.name] = (state, e)
            else:
                e.module._held_unsharded[e.name] = state.leaf(e)
            self._held.append(e)

    def _owner_state(self, entry: _Entry) -> _HeldBucket:
        """The bucket that gathers ``entry``'s parameter (a tied weight's: the first bucket that holds it)."""
        for state in self._state:
            if any(owner.param is entry.param for owner in state.owners):
                return state
        raise KeyError(entry.name)

    def _leaf_ready(self, state: _HeldBucket, leaf: torch.Tensor, reduce_dtype: torch.dtype) -> None:
        """The held weight now exists: accumulate its microbatch gradients in ``reduce_dtype`` and count them."""
        if leaf.requires_grad:
            self._hooks.append(leaf.register_post_accumulate_grad_hook(self._on_gradient(state, reduce_dtype)))

    def _on_gradient(self, state: _HeldBucket, dtype: torch.dtype):
        def hook(leaf: torch.Tensor) -> None:
            if leaf.grad.dtype != dtype:
                total = self._accumulated.get(id(leaf))
                self._accumulated[id(leaf)] = leaf.grad.to(dtype) if total is None else total.add_(leaf.grad)
                leaf.grad = None
            self._passes[id(leaf)] = self._passes.get(id(leaf), 0) + 1
            if self._expected is not None and self._passes[id(leaf)] == self._expected:
                state.complete += 1
                if state.complete == state.trainable:  # the bucket's last gradient of the step
                    self._start_reduce(state)

        return hook

    # ------------------------------------------------------------------------------------------ reduce

    @torch.no_grad()
    def _start_reduce(self, state: _HeldBucket) -> None:
        """Start the bucket's reduce-scatter. The previous one is finished first, so at most one bucket's
        ``[dp, bucket]`` buffer is in flight while the backward of the earlier layers runs."""
        with self.phase_scope("reduce"):
            self._finish_pending()
            self._pending = self._launch_reduce(state)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._write_gradients(*pending)

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish the reduce-scatters started during backward and run those of the buckets that did not start
        (every bucket, without ``microbatches``): one reduce-scatter (all-reduce for replicate) per bucket of
        the held weights' gradients, summed over the dp ranks, into each parameter's sharded ``.grad`` (added to
        it if one exists); then drop the held weights."""
        if not self._held:
            raise RuntimeError("StepGather.reduce: nothing held; call gather() first")
        self._finish_pending()
        for state in self._state:
            if not state.reduced:
                self._write_gradients(*self._launch_reduce(state))
        self.release()

    def _launch_reduce(self, state: _HeldBucket) -> tuple:
        """Start the bucket's reduce-scatter; return what ``_write_gradients`` needs once it is done."""
        state.reduced = True
        mesh, shard_dim, _, _ = self._groups[state.index]
        owners = [e for e in state.owners if e.param.requires_grad]
        if not owners:
            return state.index, [], None, []
        grads = [self._gradient(e) for e in owners]
        used = [self._used(e) for e in owners]
        for e in owners:  # the gradients now live in the buffer below
            self._accumulated.pop(id(self._leaf(e)), None)
            self._leaf(e).grad = None
        partial = [Partial()] * mesh.ndim
        target = [Replicate()] * mesh.ndim
        if shard_dim is None:
            flat = torch.cat([g.flatten() for g in grads])
        else:
            target[shard_dim] = Shard(0)
            columns = []
            for e, g in zip(owners, grads, strict=True):
                pieces = g.flatten().split([r * e.row_numel for r in e.rows])
                columns.append(torch.stack([F.pad(p, (0, e.width - p.numel())) for p in pieces]))
            flat = torch.cat(columns, dim=1).flatten()
            del columns
        del grads
        buffer = DTensor.from_local(flat, mesh, partial, run_check=False)
        return state.index, owners, buffer.redistribute(mesh, target, async_op=True).to_local(), used

    def _write_gradients(self, index: int, owners: list[_Entry], reduced: torch.Tensor | None,
                         used: list[bool]) -> None:
        """Wait for a bucket's reduce-scatter and set each parameter's sharded ``.grad`` from it."""
        if not owners:
            return
        # An async collective's result is a wrapper that waits on first use; the gradients must be plain tensors.
        reduced = reduced.wait() if hasattr(reduced, "wait") else reduced
        shard_dim, coordinate = self._groups[index][1], self._groups[index][3]
        start = 0
        for e, was_used in zip(owners, used, strict=True):
            if shard_dim is None:
                local = reduced[start: start + math.prod(e.shape)].view(e.shape)
                start += math.prod(e.shape)
            else:
                local = reduced[e.offset: e.offset + e.rows[coordinate] * e.row_numel].view(
                    e.rows[coordinate], *e.shape[1:])
            if not was_used:  # no gradient, as autograd leaves a parameter the step did not use
                continue
            grad = DTensor.from_local(local.to(e.param.dtype), e.param.device_mesh, e.param.placements,
                                      run_check=False, shape=e.param.shape, stride=e.param.stride())
            if e.param.grad is None:
                e.param.grad = grad
            else:
                e.param.grad.add_(grad)

    def _leaf(self, entry: _Entry) -> torch.Tensor:
        held = entry.module._held_unsharded[entry.name]
        return held[0] if isinstance(held, tuple) else held  # a float8 weight's gradient lands on its stand-in

    def _used(self, entry: _Entry) -> bool:
        leaf = self._leaf(entry)
        return id(leaf) in self._accumulated or leaf.grad is not None

    def _gradient(self, entry: _Entry) -> torch.Tensor:
        leaf = self._leaf(entry)
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
        self._passes.clear()
        self._pending = None
        self._state.clear()
        for e in self._held:
            e.module._held_unsharded = None
        self._held.clear()


class _HeldBucket:
    """One bucket's gathered weights: the all-gather is waited for, and the held leaves made, where the first
    of them is read (in the first microbatch's forward), not when the gathers are started."""

    def __init__(self, gather: StepGather, index: int, owners: list[_Entry], pending, shard_dim: int | None,
                 n: int) -> None:
        self.gather, self.index, self.owners = gather, index, owners
        self._pending, self._shard_dim, self._n = pending, shard_dim, n
        self._leaves: dict[int, torch.Tensor] | None = None
        self.trainable = sum(1 for e in owners if e.param.requires_grad)
        self.complete = 0
        self.reduced = False

    def leaf(self, entry: _Entry) -> torch.Tensor:
        if self._leaves is None:
            with self.gather.phase_scope("gather"):
                self._leaves = self._unpack()
        return self._leaves[id(entry.param)]

    @torch.no_grad()
    def _unpack(self) -> dict[int, torch.Tensor]:
        if self._shard_dim is None:
            fulls = self._pending
        else:
            numel = sum(e.width for e in self.gather.buckets[self.index].entries)
            rows = self._pending.view(self._n, numel)
            fulls = []
            for e in self.owners:
                pieces = [rows[r, e.offset: e.offset + e.rows[r] * e.row_numel] for r in range(self._n)]
                fulls.append(torch.cat(pieces).view(e.shape))
        self._pending = None
        leaves = {}
        for e, full in zip(self.owners, fulls, strict=True):
            if e.spec.float8 is not None:  # float8 bits, and a data-less stand-in the gradients accumulate on
                leaf = full.new_zeros((), dtype=e.spec.float8.dtype).expand(e.shape)
                leaf.requires_grad_(e.param.requires_grad)
                leaves[id(e.param)] = (leaf, full)
            else:
                leaf = full.detach().requires_grad_(e.param.requires_grad)
                leaves[id(e.param)] = leaf
            self.gather._leaf_ready(self, leaf, e.spec.mp_policy.reduce_dtype or e.param.dtype)
        return leaves


class _HeldWeights:
    """``module._held_unsharded``: name -> the held unsharded weight, made on first read (``_HeldBucket``)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[_HeldBucket, _Entry]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        state, entry = self.entries[name]
        return state.leaf(entry)
