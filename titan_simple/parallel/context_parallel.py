"""Context parallel: the ``cp`` ranks of a data-parallel group split every sequence between them.

    context = ContextParallel(mesh["cp"])        # core/build.py, when [parallelism] context_parallel_degree > 1
    apply_context_parallel(model, mesh["cp"])    # the recipe: each attention gathers keys and values over cp
    inputs, labels, attention_inputs = context.shard(inputs, labels, attention_inputs)   # the step, per batch

**Load balance (head-tail).** Under a causal mask the last tokens of a sequence attend to the most keys, so a
rank holding one contiguous slice would do unequal work. The sequence is cut into ``2 x cp`` chunks and rank
``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (one early, one late): every rank gets the same number of
query-key pairs. Inputs and labels are permuted the same way, so each rank's loss is a sum over its own tokens
and the gradient is unchanged; ``positions`` tell RoPE and the mask where each held token really is.

**Attention.** Each rank keeps its queries and all-gathers the keys and values of the whole sequence over the ``cp``
dimension: ``apply_context_parallel`` swaps each attention's class for a subclass whose kernel (``Attention.attend``)
gathers first (``gather_sequence``: a functional all-gather, traced by the compiler like SimpleFSDP's gathers; its
backward is the reduce-scatter that sums every rank's gradient of the gathered keys and values). The mask compares
positions (``key_positions``: every rank's held positions in gather order), and for block-causal attention also the
document ids of the whole row, so causal and block-causal both hold. The per-layer cost is one all-gather of ``T x
kv_dim`` keys and values forward (again when activation checkpointing recomputes) and one reduce-scatter backward;
activations and the loss's logits are ``1 / cp``.

torch's own ``context_parallel`` is not used: its SDPA path dispatches only CUDA kernels and its FlexAttention
path needs FlexAttention's backward, which torch 2.13 lacks on CPU (docs/research/issue47_long_context.md). This
is the same algorithm (all-gather K/V, a rewritten mask) with no global state, on gloo and NCCL alike.

**Weights.** Context-parallel ranks hold the same weights and compute gradients of different tokens, so
SimpleFSDP shards over ``dp_shard x cp`` (``parallel/dims.py``): the gradients' reduce-scatter sums over cp too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_simple.models.attention import AttentionInputs, KVCache, Mask
from titan_simple.models.llama3 import Attention
from titan_simple.parallel.torch_private import all_gather_with_reduce_scatter_backward


def head_tail_positions(seq_len: int, degree: int) -> torch.Tensor:
    """``[degree, seq_len // degree]``: the positions each rank holds (chunks ``r`` and ``2 degree - 1 - r`` of
    ``2 degree``)."""
    chunks = torch.arange(seq_len).view(2 * degree, seq_len // (2 * degree))
    return torch.stack([torch.cat([chunks[r], chunks[2 * degree - 1 - r]]) for r in range(degree)])


class ContextParallel:
    """This rank's share of every sequence, and the loss summed back over the ``cp`` group."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.degree = mesh.size()
        self.rank = mesh.get_local_rank()
        self._orders: dict[tuple[int, torch.device], torch.Tensor] = {}

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor, attention_inputs: AttentionInputs | None
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        """This rank's tokens and labels of ``[batch, seq]`` rows, and the model's attention inputs: ``positions``
        (held, ``[batch, seq / cp]``) and ``key_positions`` (every rank's, in the order the keys are gathered);
        ``document_ids`` stay whole rows (the mask looks them up by position)."""
        batch, seq_len = inputs.shape
        key = (seq_len, inputs.device)
        if key not in self._orders:  # the same for every batch: made on the device once
            self._orders[key] = head_tail_positions(seq_len, self.degree).to(inputs.device)
        order = self._orders[key]
        mine = order[self.rank]
        sharded = dataclasses.replace(attention_inputs or AttentionInputs(),
                                      positions=mine.expand(batch, -1).contiguous(),
                                      key_positions=order.reshape(1, -1).expand(batch, -1).contiguous())
        return inputs[:, mine], labels[:, mine], sharded

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a loss summed over this rank's tokens) summed over the ``cp`` group: every rank then holds
        its data-parallel slice's loss."""
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


def gather_sequence(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` ``[batch, seq / cp, ...]`` of every ``cp`` rank, concatenated along dim 1 in rank order. Backward:
    the reduce-scatter of the gathered gradient (each rank's is a partial sum over its own queries). The gather
    runs along dim 0 (the one the collective concatenates), so the sequence goes first and back."""
    gathered = all_gather_with_reduce_scatter_backward(x.transpose(0, 1).contiguous(), group_name)
    return gathered.transpose(0, 1)


class ContextParallelAttention(Attention):
    """An attention whose kernel sees the keys and values of the whole sequence: gathered over the ``cp`` group
    ``group_name`` before the plain kernel runs. ``apply_context_parallel`` swaps it in (a subclass per group, so
    that the module holds no state of its own: parameters, ``state_dict`` and the TP plan see an ``Attention``)."""

    group_name: str = ""  # the process group the keys and values are gathered over (the comm plan labels it "cp")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None = None,
               cache: KVCache | None = None, layer: str = "") -> torch.Tensor:
        k, v = gather_sequence(k, self.group_name), gather_sequence(v, self.group_name)
        return super().attend(q, k, v, mask, cache, layer)


def _context_parallel_class(group_name: str) -> type[ContextParallelAttention]:
    if group_name not in _CONTEXT_PARALLEL_CLASSES:
        _CONTEXT_PARALLEL_CLASSES[group_name] = type(
            Attention.__name__, (ContextParallelAttention,), {"group_name": group_name})
    return _CONTEXT_PARALLEL_CLASSES[group_name]


_CONTEXT_PARALLEL_CLASSES: dict[str, type[ContextParallelAttention]] = {}


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every attention layer of ``model`` (a model or a pipeline stage) gathers its keys and values over
    ``mesh`` (``context_parallel_mesh``): its class is swapped, in place."""
    attention_class = _context_parallel_class(mesh.get_group().group_name)
    for block in model.layers.values():
        if type(block.attention) is not Attention:
            raise TypeError(f"context parallel swaps a plain Attention, not {type(block.attention).__name__}")
        block.attention.__class__ = attention_class


def context_parallel_group_names(model: nn.Module) -> set[str]:
    """The process groups ``model``'s attention layers gather keys and values over (the comm plan labels them)."""
    return {module.group_name for module in model.modules() if isinstance(module, ContextParallelAttention)}


def context_parallel_mesh(world: DeviceMesh) -> DeviceMesh:
    """The mesh the keys and values are gathered over: ``world["cp"]``, except where context parallel is the whole
    world. There the ``cp`` dimension's group is the default group, which SimpleFSDP's ``dp_shard_cp`` also gets, so
    the weights' gathers and the attention's could not be told apart (comm plan, dry run): context parallel then
    gets a group of its own. The same object at every call for one world mesh (making a group is collective)."""
    held, cp = _CONTEXT_PARALLEL_MESHES.get(id(world), (None, None))
    if held is world:
        return cp
    cp = world["cp"]
    if cp.size() == dist.get_world_size():
        group = dist.new_group(ranks=list(range(cp.size())))
        cp = DeviceMesh.from_group(group, cp.device_type, mesh_dim_names=("cp",))
    _CONTEXT_PARALLEL_MESHES[id(world)] = (world, cp)  # holds the world: its id stays its own
    return cp


_CONTEXT_PARALLEL_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}
