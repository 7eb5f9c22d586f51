"""Trace one training step of one rank on the meta device: live tensor memory, the cost of every op, and
every collective, as the real code issues them.

The model is parallelized by the real recipe on a fake process group (``fake_pg``), so its parameters are
DTensors on the meta device with this rank's local shapes. Running forward, backward and the optimizer step
on them executes every op of the step (DTensor redistributions, the c10d functional collectives SimpleFSDP
and tensor parallel issue, activation-checkpoint recomputation in backward, foreach AdamW) without
allocating or computing anything. ``StepTracer`` is a ``TorchDispatchMode`` that sits *under* DTensor (it
returns ``NotImplemented`` for DTensor arguments, so DTensor unwraps and its local ops come back through the
mode) and records:

* **memory**: the bytes of the distinct tensor storages alive (each counted once however many views share it;
  a weakref finalizer on the storage subtracts it when freed), sampled after every op, with per-phase peaks
  (``probes.LiveStorageBytes``, which ``scripts/benchmarks/measure_memory.py`` shares);
* **ops**: for every op that does work, its FLOPs (``torch.utils.flop_counter``'s formulas) and the bytes it
  reads and writes, and whether it is a matmul, attention or memory-bound op; views and metadata ops are free;
* **collectives**: kind, process group, payload bytes and dtype of every ``_c10d_functional`` collective.

DTensor learns each output's global shape by running the op on fake tensors of the *global* shape
(``ShardingPropagator._propagate_tensor_meta_non_cached``). In a real step those are free metadata; here every
tensor is a meta tensor, so the tracer is paused inside that method (``ignoring_shape_propagation``, the
dry run's second private API, guarded by a test): counting them put a 31 GiB phantom ``[tokens, vocab]``
tensor into the 70B peak.

Attention: on the meta device ``F.scaled_dot_product_attention`` picks the math kernel, which materializes the
``seq x seq`` score matrix that a fused kernel never does. ``fused_attention()`` makes the model call the fused
CPU flash kernel instead (``_scaled_dot_product_flash_attention_for_cpu``: the same signature and saved
tensors -- q, k, v, output, logsumexp -- as the GPU flash kernel, and GQA without repeating KV heads), which
is also what the model runs on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from titan_simple.compile.comm_plan import COLLECTIVE_KINDS
from titan_simple.dry_run.live_storage import LiveStorageBytes
from titan_simple.dry_run.torch_private import FakeTensor, ShardingPropagator, tree_leaves
from titan_simple.models import llama3
from titan_simple.parallel.activation_checkpoint import is_float8_scaling

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_MATMUL = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ATTENTION_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# Ops that allocate or move no data worth pricing (metadata, aliasing, allocation without a fill).
_FREE = {
    _aten.detach.default, _aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
    _aten.empty_strided.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
    _aten.scalar_tensor.default, _aten._local_scalar_dense.default, _c10d.wait_tensor.default,
    _c10d._wrap_tensor_autograd.default,
}


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclass
class OpCost:
    category: str  # "matmul" | "attention" | "memory"
    flops: float  # work the hardware does (causal attention: the unmasked half)
    nbytes: int  # bytes read + written
    phase: str
    float8: bool = False  # a float8 matmul (torchao's): priced at the device's float8 peak
    fused_nbytes: int | None = None  # compiled: the bytes left once Inductor fuses a float8 cast (see _cast_bytes)


@dataclass
class Collective:
    kind: str
    group: str  # c10d group name; the dry run maps it to a mesh dimension
    nbytes: int  # all_gather: the gathered output; reduce_scatter / all_reduce: the input
    dtype: str
    phase: str
    next_op: int = 0  # index in ``StepTracer.ops`` of the first op recorded after it (what it feeds / follows)


class StepTracer(LiveStorageBytes):
    """See the module docstring. ``phase`` names the part of the step that costs and peaks belong to.
    ``ignore_meta_tensors``: measuring a real step (tensors on a real device), meta tensors are metadata, never
    memory."""

    def __init__(self, ignore_meta_tensors: bool = False) -> None:
        super().__init__()
        self.ignore_meta_tensors = ignore_meta_tensors
        self.ops: list[OpCost] = []
        self.collectives: list[Collective] = []

    _last_upcast: tuple[int, int] | None = None  # the last op, when it was x.float(): (id of its output, index)

    def _storage_of(self, t: object) -> torch.UntypedStorage | None:
        storage = super()._storage_of(t)
        if storage is not None and self.ignore_meta_tensors and storage.device.type == "meta":
            return None
        return storage

    # ------------------------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor unwraps; its local ops come back through this mode
        kwargs = kwargs or {}
        if _PROPAGATING[0] or any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # DTensor's shape propagation: no real step runs these
        out = func(*args, **kwargs)
        tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in tensors_in + tensors_out:
            self.track(t)
        self.sample(str(func))
        self._record(func, args, kwargs, out, tensors_in, tensors_out)
        return out

    def _record(self, func, args, kwargs, out, tensors_in, tensors_out) -> None:
        kind = COLLECTIVE_KINDS.get(func)
        if kind is not None:
            # As the comm plan reads them: the gathered output of an all-gather, else the input (every tensor of
            # a coalesced one); the group name is the last positional argument of every functional collective.
            inputs = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            payload = tensors_out if kind == "all_gather" else inputs
            self.collectives.append(Collective(kind, str(args[-1]), sum(_nbytes(t) for t in payload),
                                               str(payload[0].dtype).removeprefix("torch."), self.phase,
                                               next_op=len(self.ops)))
            return
        if func in _FREE or _is_view(func):
            return
        nbytes = sum(_nbytes(t) for t in {id(t): t for t in tensors_in + tensors_out}.values())
        if func is _ATTENTION_FORWARD or func is _ATTENTION_BACKWARD:
            q, k = args[0], args[1]
            if func is _ATTENTION_BACKWARD:  # (grad_out, query, key, ...)
                q, k = args[1], args[2]
            batch, heads, sq, dh = q.shape
            flops = 4.0 * batch * heads * sq * k.shape[2] * dh  # Q K^T and P V, 2 FLOPs per multiply-add
            flops *= 0.5  # causal: fused kernels skip the masked half
            if func is _ATTENTION_BACKWARD:
                flops *= 2.5  # FlashAttention-2 backward: 5 matmuls (S recomputed, dP, dV, dQ, dK) vs 2
            self.ops.append(OpCost("attention", flops, nbytes, self.phase))
            return
        if func in _MATMUL:
            formula = flop_registry[func.overloadpacket]
            flops = float(formula(*args, **kwargs, out_val=out))
            float8 = any(_is_float8(t) for t in tensors_in)  # torchao's Float8TrainingTensor: a _scaled_mm inside
            self.ops.append(OpCost("matmul", flops, nbytes, self.phase, float8=float8))
            return
        fused = _cast_bytes(func, args, out)
        if fused == 0 and func is _aten.mul.Tensor and self._last_upcast is not None:
            upcast, index = self._last_upcast  # x.float() * scale: Inductor fuses the upcast into the cast too
            if any(id(t) == upcast for t in args[:2]):
                self.ops[index].fused_nbytes = 0
        self._last_upcast = None
        if func is _aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self._last_upcast = (id(out), len(self.ops))  # an id: a reference would keep the tensor alive
        self.ops.append(OpCost("memory", 0.0, nbytes, self.phase, fused_nbytes=fused))


_PROPAGATING = [0]  # > 0 while DTensor propagates shapes (see ignoring_shape_propagation)


@contextlib.contextmanager
def ignoring_shape_propagation() -> Iterator[None]:
    """Inside, ops DTensor runs only to learn output shapes are invisible to ``StepTracer``."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return original(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _is_float8(t: torch.Tensor) -> bool:
    data = getattr(t, "_data", None)  # torchao's Float8TrainingTensor keeps its float8 bits there
    return t.dtype in _FLOAT8 or (isinstance(data, torch.Tensor) and data.dtype in _FLOAT8)


def _nbytes(t: torch.Tensor) -> int:
    data = getattr(t, "_data", None)
    if isinstance(data, torch.Tensor) and data.dtype in _FLOAT8:  # a float8 tensor subclass: its bits are its bytes
        return data.numel() * data.element_size()
    return t.numel() * t.element_size()


# A float8 cast as torchao writes it, op by op: |x| -> max (the amax), x.float() * scale -> clamp -> to(float8). Eager
# runs each op over the whole tensor; Inductor fuses the chain into an amax reduction (reads x) and one cast kernel
# (reads x, writes the float8 bits). Compiled, the dry run prices the chain as those two reads and one write, with x in
# bf16 (the compute dtype these casts see on GPUs), the x.float() right before ``* scale`` included (StepTracer
# _record): what the elementwise fraction would leave is several times more.
_REDUCTIONS = {_aten.max.default, _aten.amax.default}


def _cast_bytes(func, args, out) -> int | None:
    """The compiled cost in bytes of an op of a float8 cast (``None``: not one, priced as any elementwise op)."""
    if is_float8_scaling(func, args):
        return 0  # |x|, x * scale, the clamp: fused into the amax and the cast (the checkpoint policy's rule)
    if func in _REDUCTIONS and isinstance(args[0], torch.Tensor):
        return _nbytes(args[0])  # a reduction reads its input once, fused or not
    if func is _aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype in _FLOAT8:
        return out.numel() * (out.element_size() + 2)  # reads x (bf16), writes the bits
    return None


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Inside, the Llama 3 attention runs the fused flash kernel (see the module docstring)."""
    original, original_mask = llama3._grouped_query_attention, llama3.attention_mask

    def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        if mask is not None:  # decoding with a KV cache: not a training step, keep the model's own path
            return original(q, k, v, mask)
        return _ATTENTION_FORWARD(q, k, v, dropout_p=0.0, is_causal=True)[0]

    def no_mask(*args, **kwargs) -> None:
        # Priced as causal: FlexAttention's block-causal skips more (an upper bound; SDPA's dense mask skips
        # nothing, docs/dry_run.md), and context parallel's queries against the gathered keys do half of their
        # [seq / cp, seq] pairs under head-tail balance, as a causal square of the same area does. FlexAttention's
        # block mask is a few MiB, not a dense tensor to count.
        return None

    llama3._grouped_query_attention, llama3.attention_mask = flash_attention, no_mask
    try:
        yield
    finally:
        llama3._grouped_query_attention, llama3.attention_mask = original, original_mask
