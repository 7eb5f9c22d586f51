"""Activation checkpointing as ONE selective-checkpoint policy per wrapped module.

Two users want to decide what a module keeps for backward:

* SimpleFSDP's reshard-after-forward (``reshard_policy``): the all-gathered weights, their dtype cast and
  every view of them must be recomputed in backward, so the unsharded weights die after forward;
* activation checkpointing proper (``full_recompute_policy``, ``SelectiveOpPolicy``): which activations to
  save and which to recompute.

Each is a *policy*: ``policy(ctx, op, *args, **kwargs)`` returns a ``CheckpointPolicy`` or ``None`` ("no
opinion"). ``compose_policies(a, b, ...)`` asks them in order and takes the first opinion; with none, the
op's output is saved, so a module checkpointed only for resharding keeps the activations a module without
checkpointing would. ``apply_checkpoint(modules, policy)`` runs each module's forward under
``torch.utils.checkpoint`` with that policy; a module that is already checkpointed gets the new policy
composed in front of its old one, never a second, nested checkpoint.

The wrapper swaps the module's class for a subclass whose ``forward`` calls the checkpoint: the module tree,
and so every parameter name in ``state_dict()``, stays exactly as it was (torch's ``checkpoint_wrapper``
would insert ``_checkpoint_wrapped_module.`` into every name).

Compiled, the checkpoint's ``context_fn`` is part of AOTAutograd's cache key: it must carry a stable
``cache_hash`` and pickle, or the graph is never cached. So every policy has a ``cache_key`` that
describes it completely, and the ``context_fn`` names its policy by that key (``_POLICIES``), not by reference.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.distributed.tensor  # noqa: F401 -- registers the _c10d_functional ops named below
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

Policy = Callable[..., CheckpointPolicy | None]

_c10d = torch.ops._c10d_functional
# Non-view ops DTensor runs between a parameter shard and its unsharded copy: the cast to param_dtype, the
# padding of an uneven shard, and the concatenation when the gathered dim is not dim 0 (or is strided).
# In model code these ops only move data (``x.float()``, ``torch.stack``), so recomputing them there too
# costs a copy and never more memory.
_GATHER_DATA_OPS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.constant_pad_nd.default,
    torch.ops.aten.cat.default,
    _c10d.wait_tensor.default,
    _c10d._wrap_tensor_autograd.default,
}


# Float8 scaling (torchao's casts of activations and gradients, and of weights gathered in the param dtype): |x| for
# the amax, x * scale, and the clamp before the cast to float8. Elementwise, cheap to redo, and
# no backward needs them (a float8 matmul saves its own high-precision inputs); cached, they would hold two fp32
# copies of every float8 linear's input. The model itself uses neither.
_FLOAT8_SCALING_OPS = {torch.ops.aten.abs.default, torch.ops.aten.clamp.default}
# The amax reductions behind float8 scales: max of |x| (tensorwise, 0-dim) and amax of |x| along a dim (rowwise, one
# per row or column). The op policy saves them (tiny): a recomputed cast then reuses the forward's scale, as TorchTitan
# saves ``aten.max``; rowwise rounds its scales to powers of two, so an amax one ulp off would halve or double a row.
FLOAT8_AMAX_OPS = {torch.ops.aten.max.default, torch.ops.aten.amax.default}


def _is_weight_scale(weight: object, scale: object) -> bool:
    """A rowwise scale of a 2-D weight: one fp32 factor per row ``[rows, 1]`` or per column ``[1, cols]``. (The
    model's own broadcast multiplies -- RMSNorm, RoPE -- act on 3-D or 4-D activations.)"""
    if not (isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor)):
        return False
    if weight.dim() != 2 or scale.dim() != 2 or scale.dtype != torch.float32:
        return False
    return scale.shape in ((weight.shape[0], 1), (1, weight.shape[1])) and scale.numel() < weight.numel()


def is_float8_scaling(op, args) -> bool:
    """One of ``_FLOAT8_SCALING_OPS``, torchao's tensorwise ``x * scale`` (a 0-dim scale), or its rowwise
    ``weight * scale`` (``_is_weight_scale``): what SimpleFSDP's reshard policy recomputes with the gather."""
    if op in _FLOAT8_SCALING_OPS:
        return True
    if op is not torch.ops.aten.mul.Tensor:
        return False
    first, second = args[0], args[1] if len(args) > 1 else None
    if any(isinstance(a, torch.Tensor) and a.dim() == 0 for a in (first, second)):
        return True
    return _is_weight_scale(first, second) or _is_weight_scale(second, first)


def is_view_op(op) -> bool:
    """Ops whose output aliases an input (``view``, ``t``, ``slice``, ``split``, ...). Saving one keeps its
    whole base alive and recomputing it is free, so they are never worth saving."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def reshard_policy(data_parallel_group_names: Iterable[str]) -> Policy:
    """Recompute in backward exactly what produces an unsharded parameter: the all-gathers over the
    data-parallel groups, the cast and padding before them, the unpadding/concatenation after them, and
    views; and float8 scaling's elementwise copies (``is_float8_scaling``). All-gathers over other groups
    (tensor-parallel activations) are left to the next policy."""
    groups = frozenset(data_parallel_group_names)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy | None:
        if op is _c10d.all_gather_into_tensor.default:
            return CheckpointPolicy.MUST_RECOMPUTE if args[2] in groups else None
        if op in _GATHER_DATA_OPS or is_view_op(op) or is_float8_scaling(op, args):
            return CheckpointPolicy.MUST_RECOMPUTE
        return None

    policy.cache_key = f"reshard({','.join(sorted(groups))})"
    return policy


def full_recompute_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Full activation checkpointing: keep only the module's inputs, recompute everything in backward."""
    return CheckpointPolicy.PREFER_RECOMPUTE


full_recompute_policy.cache_key = "full"


def compose_policies(*policies: Policy | None) -> Callable[..., CheckpointPolicy]:
    """The first policy with an opinion decides; with none, the output is saved (as without checkpointing)."""
    chain = tuple(p for p in policies if p is not None)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        for p in chain:
            decision = p(ctx, op, *args, **kwargs)
            if decision is not None:
                return decision
        return CheckpointPolicy.PREFER_SAVE

    # A policy without a key of its own gets one that is new in every process: never cached, never stale.
    policy.cache_key = " | ".join(getattr(p, "cache_key", None) or f"unkeyed-{id(p)}" for p in chain)
    policy.chain = chain  # what apply_checkpoint composes a later policy with
    # A policy that counts ops (SelectiveOpPolicy) starts each checkpointed forward with a fresh count.
    policy.fresh = lambda: compose_policies(*(getattr(p, "fresh", lambda p=p: p)() for p in chain))
    return policy


_CHECKPOINTED_CLASSES: dict[type, type] = {}
_POLICIES: dict[str, Policy] = {}  # cache_key -> the composed policy it describes
with open(__file__, "rb") as _source:  # a changed policy must never reuse a graph compiled with the old one
    _SOURCE_HASH = hashlib.sha256(_source.read()).hexdigest()[:16]


def _selective_contexts(cache_key: str):
    """The checkpoint's ``context_fn``: called once per checkpointed forward, so a counting policy starts
    fresh each time."""
    return create_selective_checkpoint_contexts(_POLICIES[cache_key].fresh(), allow_cache_entry_mutation=True)


def _policy_types(policy: Policy) -> tuple[type, ...]:
    return tuple(type(p) for p in getattr(policy, "chain", (policy,)))


def _context_fn(policy: Policy) -> Callable:
    """A ``context_fn`` AOTAutograd can cache: a partial of a module-level function and a string (it pickles),
    with ``cache_hash`` (this file's source and the policy's key). The key names the policy process-wide, so two
    policies of other classes under one key are refused: the second would silently run the first's decisions."""
    registered = _POLICIES.setdefault(policy.cache_key, policy)
    if registered is not policy and _policy_types(registered) != _policy_types(policy):
        raise ValueError(f"activation checkpointing: policies of other classes share the cache key "
                         f"{policy.cache_key!r}; give each class a cache_key of its own")
    context_fn = partial(_selective_contexts, policy.cache_key)
    context_fn.cache_hash = f"{_SOURCE_HASH}:{policy.cache_key}"
    return context_fn


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    if getattr(cls, "_is_checkpointed", False):
        return cls
    if cls not in _CHECKPOINTED_CLASSES:
        original_forward = cls.forward

        def forward(self, *args, **kwargs):
            # Model code mutates some saved outputs in place (rms_norm: ``mean(x^2).add_(eps)``). The cache
            # then holds the mutated value, and the in-place op itself is replayed from the cache, not
            # re-run: correct, so allow it rather than fail.
            return checkpoint(original_forward, self, *args, use_reentrant=False,
                              context_fn=self._checkpoint_context_fn, **kwargs)

        _CHECKPOINTED_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_is_checkpointed": True})
    return _CHECKPOINTED_CLASSES[cls]


def apply_checkpoint(modules: nn.Module | Iterable[nn.Module], policy: Policy) -> None:
    """Checkpoint each module's forward with ``policy``, in place (``modules``: one module, an iterable, or
    the entries of a ModuleList / ModuleDict). Applying a second policy to a module
    composes it in front of the first (the later caller's opinion wins), so SimpleFSDP can add its reshard
    policy to blocks that activation checkpointing already wraps."""
    if isinstance(modules, nn.ModuleDict):
        modules = modules.values()
    elif isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList):
        modules = [modules]
    for module in modules:
        previous = getattr(module, "_checkpoint_policy", None)
        chain = getattr(previous, "chain", (previous,))
        module._checkpoint_policy = compose_policies(policy, *chain)
        module._checkpoint_context_fn = _context_fn(module._checkpoint_policy)
        module.__class__ = _checkpointed_class(type(module))


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(type(module), "_is_checkpointed", False)


# ---------------------------------------------------------------------------------------------- AC modes

_aten = torch.ops.aten
# The block's projections (linear layers): what every-second-matmul counts. Attention's own matmuls never run as these:
# a fused kernel is one op (_ATTENTION), and SDPA's math fallback multiplies batched (bmm), so a fallback cannot
# shift the count.
_MATMULS = {_aten.mm.default, _aten.addmm.default}
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
}
# Tensor-parallel activation collectives whose outputs are saved: sequence parallel's reduce-scatters (a sequence
# shard; recomputing one would rerun its matmul and the collective) and the all-reduce without it. Sequence
# parallel's all-gathers are re-gathered in backward instead (SelectiveOpPolicy). SimpleFSDP's weight all-gathers
# are decided before (reshard_policy: recomputed).
_SAVED_TENSOR_PARALLEL_COLLECTIVES = {_c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default}
# The selective_ac_option names of the op-level policies.
SELECTIVE_OP_POLICIES = ("op", "op_all_matmuls")


def _partial_product(op, args) -> bool:
    """A row-parallel matmul under tensor parallel (``wo``, ``w2``): its input shards the contracted dim, so its output
    is a full-sequence partial sum that only the reduce-scatter after it reads, and no backward needs. Saved, it
    would be the largest tensor a block keeps per rank; compiled, the partitioner drops it anyway. Eager only:
    a compiled trace sees plain tensors."""
    index = 1 if op is _aten.addmm.default else 0
    first = args[index] if len(args) > index else None
    return isinstance(first, DTensor) and any(p.is_shard(first.ndim - 1) for p in first.placements)


class SelectiveOpPolicy:
    """Op-level selective AC: save the outputs of the expensive ops, recompute the cheap ones around them
    (norms, activations, RoPE, casts, residual adds).

    ``every_second_matmul=True`` (``selective_ac_option = "op"``, TorchTitan's trade-off): also recompute every
    second matmul of each block's forward, counting in call order from 1 and recomputing the even ones. In a
    Llama block the matmuls run wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2 are saved, wk, wo and w3
    recomputed. ``False`` (``"op_all_matmuls"``): every matmul output is saved (less recompute, more memory).
    Attention outputs (of the fused kernels, flex attention, or P.V of SDPA's math fallback, whose score matrix Q K^T
    is recomputed as the fused kernels do), tensor parallel's reduce-scatters and float8's amaxes
    (``FLOAT8_AMAX_OPS``) are always saved.

    A row-parallel matmul's partial sums are never saved (``_partial_product``): the reduce-scatter's output is.
    Sequence parallel's all-gathers over ``tensor_parallel_groups`` are recomputed: each gathers a sublayer's
    normalized input to the full sequence, and saving it would keep a full-sequence copy per sublayer (``tp`` times
    its shard; at tp2 they were 40% of a block's saved bytes). Backward gathers again, as Megatron's sequence
    parallel does: one more all-gather per sublayer, no more memory than the shard.

    The matmul count restarts for every checkpointed forward: ``fresh()`` gives each call its own counters, one
    for the forward and one for its recomputation: a torch that calls the policy again while recomputing
    (``ctx.is_recompute``) must count from the start there too, or it would recompute the wrong matmuls."""

    def __init__(self, every_second_matmul: bool, tensor_parallel_groups: Iterable[str] = (),
                 save_float8_amax: bool = True) -> None:
        self.every_second_matmul = every_second_matmul
        self.tensor_parallel_groups = frozenset(tensor_parallel_groups)
        self.save_float8_amax = save_float8_amax
        self.cache_key = ("selective_op(every second matmul)" if every_second_matmul else "selective_op(all matmuls)")
        if type(self) is not SelectiveOpPolicy:  # a subclass decides (or records) otherwise: a key of its own
            self.cache_key = f"{type(self).__module__}.{type(self).__qualname__}: {self.cache_key}"
        if self.tensor_parallel_groups:
            self.cache_key += f" regather({','.join(sorted(self.tensor_parallel_groups))})"
        if not save_float8_amax:
            self.cache_key += " recompute-amax"
        self.matmuls = {False: 0, True: 0}  # is_recompute -> matmuls seen
        self.batched_matmuls = {False: 0, True: 0}  # the same for SDPA's math fallback: its 1st, 3rd, ... are Q K^T

    def fresh(self) -> SelectiveOpPolicy:
        """This policy (of its own class: a subclass decides as itself) with its counts at zero."""
        policy = copy.copy(self)
        policy.matmuls, policy.batched_matmuls = {False: 0, True: 0}, {False: 0, True: 0}
        return policy

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _MATMULS:
            recomputing = bool(getattr(ctx, "is_recompute", False))
            self.matmuls[recomputing] += 1
            if self.every_second_matmul and self.matmuls[recomputing] % 2 == 0 or _partial_product(op, args):
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if op is _aten.bmm.default:  # SDPA's math fallback, Q K^T then P.V: recompute the scores, save the output
            recomputing = bool(getattr(ctx, "is_recompute", False))
            self.batched_matmuls[recomputing] += 1
            scores = self.batched_matmuls[recomputing] % 2 == 1
            return CheckpointPolicy.PREFER_RECOMPUTE if scores else CheckpointPolicy.MUST_SAVE
        if op is _c10d.all_gather_into_tensor.default and args[2] in self.tensor_parallel_groups:
            return CheckpointPolicy.MUST_RECOMPUTE
        if op in _ATTENTION or op in _SAVED_TENSOR_PARALLEL_COLLECTIVES or (
                op in FLOAT8_AMAX_OPS and self.save_float8_amax):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(blocks: nn.ModuleDict | nn.ModuleList, mode: str, option: str = "op",
                                   tensor_parallel_groups: Iterable[str] = (), save_float8_amax: bool = True) -> None:
    """``full``: every block keeps only its input. ``selective`` + ``op``: every block saves attention outputs
    and every second matmul output (``SelectiveOpPolicy``); ``op_all_matmuls``: every matmul output.
    ``selective`` + ``N``: every N-th block is fully checkpointed. ``tensor_parallel_groups``: the groups whose
    activation all-gathers the op policies gather again in backward. ``save_float8_amax``: see SelectiveOpPolicy."""
    blocks = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
    if mode == "full":
        apply_checkpoint(blocks, full_recompute_policy)
    elif mode == "selective" and option in SELECTIVE_OP_POLICIES:
        apply_checkpoint(blocks, SelectiveOpPolicy(every_second_matmul=option == "op",
                                                   tensor_parallel_groups=tensor_parallel_groups,
                                                   save_float8_amax=save_float8_amax))
    elif mode == "selective":
        every = int(option)
        apply_checkpoint([b for i, b in enumerate(blocks) if (i + 1) % every == 0], full_recompute_policy)
    elif mode != "none":
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown")
