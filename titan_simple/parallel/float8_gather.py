"""SimpleFSDP gathering tensorwise float8 weights in float8: half the all-gather bytes of bf16.

A tensorwise float8 linear (torchao's ``Float8Linear``) casts its whole weight to float8 e4m3 with one scale,
``448 / amax(|W|)``, right before its matmul. Gathered in bf16 and then cast, the all-gather moves 2 bytes per
element; cast first and gathered in float8, 1. Casting a shard needs the amax of the *whole* weight, which no rank
holds, so once per step, before the first forward (``refresh_float8_weights``):

    one all-reduce(max) of a vector holding every float8 weight's local amax -> each weight's scale
    each local shard cast with it, (shard * scale).clamp(+-448) -> float8 (``cast_shard``), kept as uint8

and each SimpleFSDP gather of such a weight (``Float8Gather.unshard``, in place of ``simple_fsdp._unshard``):

1. all-gathers the shard's float8 bits as uint8 (gloo has no float8 type; NCCL moves the same bytes either way);
2. hands the linear torchao's ``Float8TrainingTensor`` (the bits and the scale), which it multiplies as it is.

The cast bits (1 byte per local element, 1/16 of what AdamW keeps per parameter in fp32) live through the step; the
gathered ones die after forward and are gathered again in backward like any resharded weight.

The backward is SimpleFSDP's: the high-precision weight gradient reduce-scattered (all-reduced over
``dp_replicate`` for hybrid_shard) in ``reduce_dtype``. The gradient cannot flow through the float8 bits (autograd
would cast it to float8), so a data-less stand-in of the weight carries it (``_ReduceGradient``).

The numbers are those of gathering in bf16: the amax is exact (max of rounded values = rounded max), and the scale
and the elementwise cast are torchao's own functions applied to the same values. So losses are bitwise equal in
eager, ``tests/test_float8_gather.py``. Gathering once per step (``fsdp_gather.py``) gathers the same bits in
byte buckets of their own. Under tensor parallel each rank gathers its TP shard of the weight, cast with the
whole weight's scale, and the linear gets a DTensor of float8 shards, as torchao's float8 TP styles expect.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_simple.parallel.simple_fsdp import chunk_rows, unsharded_local_shape
from titan_simple.parallel.torch_private import (
    StridedShard,
    all_gather_single,
    all_reduce,
    reduce_scatter_single,
    wait_tensor,
)

FLOAT8 = torch.float8_e4m3fn
SCALE_BUFFER = "float8_weight_scale"  # each float8-gathered linear's scale, set by refresh_float8_weights
BITS_BUFFER = "float8_weight_bits"  # ... and its shard cast with it, as uint8


def cast_shard(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``shard`` in ``dtype`` (the gathered weight's dtype), scaled and saturated to float8 exactly as torchao casts a
    whole weight, as uint8 bits. Run once per step, outside any compiled graph (``refresh_float8_weights``)."""
    from torchao.float8.float8_utils import to_fp8_saturated  # noqa: PLC0415 -- an optional dependency

    return to_fp8_saturated(shard.to(dtype).to(torch.float32) * scale, FLOAT8).view(torch.uint8)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


class _ReduceGradient(torch.autograd.Function):
    """Stands for the unsharded weight in autograd: forward returns a stand-in of its shape that holds no data
    (one element, expanded); backward reduces the high-precision weight gradient as SimpleFSDP's redistribute
    does, in ``reduce_dtype`` and in DTensor's order: all-reduce over the replica groups (hybrid_shard), then
    reduce-scatter over the shard group. The same sums in the same order: bitwise the same gradients."""

    @staticmethod
    def forward(ctx, shard, shape, dtype, shard_group, rows, coordinate, replicate_groups, reduce_dtype):
        ctx.layout = (shard_group, rows, coordinate, replicate_groups, reduce_dtype, shard.dtype)
        return shard.new_zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        shard_group, rows, coordinate, replicate_groups, reduce_dtype, shard_dtype = ctx.layout
        grad = grad.to(reduce_dtype)
        for group in replicate_groups:  # first, as DTensor's redistribute orders hybrid_shard's reductions
            grad = all_reduce(grad, "sum", group)
        if shard_group is not None:
            width = max(rows)
            if min(rows) != width:  # uneven shards: pad each rank's rows to the widest
                grad = torch.cat([_pad_rows(block, width) for block in grad.split(list(rows))])
            # No explicit waits: the collective's tensor waits where it is first read (the optimizer's, unless a
            # pass moves it), as DTensor's reductions do; Inductor's bucketing expects that order.
            grad = reduce_scatter_single(grad, "sum", 0, shard_group)
            if min(rows) != width:
                grad = grad[: rows[coordinate]]
        return grad.to(shard_dtype), None, None, None, None, None, None, None


class _AsFloat8(torch.autograd.Function):
    """The gathered float8 bits as the torchao ``Float8TrainingTensor`` a float8 linear multiplies as it is; its
    (high-precision) gradient passes to ``stand_in`` unchanged, as torchao's own cast passes it."""

    @staticmethod
    def forward(ctx, stand_in, bits, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole  # noqa: PLC0415

        return Float8TrainingTensor(bits.view(FLOAT8), scale, stand_in.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


@dataclass(frozen=True)
class Float8Gather:
    """How one float8 linear's weight is gathered in float8: the dp group it is sharded over, the rows each rank
    holds there, and the replica groups its gradient is also summed over (hybrid_shard)."""

    shard_group: str | None
    rows: tuple[int, ...]
    coordinate: int
    replicate_groups: tuple[str, ...]
    dtype: torch.dtype  # the gathered weight's dtype (param_dtype): what the cast starts from
    reduce_dtype: torch.dtype
    mm_config: object  # the linear's torchao LinearMMConfig
    amax_groups: tuple[str, ...] = ()  # where the weight's pieces are: the shard group, and TP's groups

    def unshard(self, module: nn.Module, param: DTensor) -> torch.Tensor:
        """The gathered weight as the ``Float8TrainingTensor`` the linear multiplies; its backward reduces the
        gradient into ``param``'s shard."""
        return self.assemble(module, *self.gather(module, param))

    def gather(self, module: nn.Module, param: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two plain tensors the weight is made of: the gradient's stand-in and the gathered float8 bits (what a
        compiled region hands the next one: a tensor subclass crossing a graph boundary would make AOTAutograd
        expect a float8 gradient). The bits gathered are this step's cast of the shard (``refresh_float8_weights``):
        in a compiled graph the gather then derives from one input, which Inductor's bucketing requires."""
        shard = param.to_local()
        with torch.no_grad():  # the bits carry no gradient: _ReduceGradient's stand-in does
            bits = module._buffers[BITS_BUFFER]
            if self.shard_group is not None:
                width = max(self.rows)
                bits = wait_tensor(all_gather_single(_pad_rows(bits, width), 0, self.shard_group))
                if min(self.rows) != width:  # uneven shards (torch.chunk's split): drop each rank's padding
                    bits = torch.cat([block[:n] for block, n in zip(bits.split(width), self.rows, strict=True)])
        shape = (sum(self.rows), *shard.shape[1:])
        stand_in = _ReduceGradient.apply(shard, shape, self.dtype, self.shard_group, self.rows, self.coordinate,
                                         self.replicate_groups, self.reduce_dtype)
        return stand_in, bits

    def assemble(self, module: nn.Module, stand_in: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        return _AsFloat8.apply(stand_in, bits, module._buffers[SCALE_BUFFER], self.mm_config)


def _float8_gather(module: nn.Module, param: DTensor, spec) -> Float8Gather:
    """Under tensor parallel the gathered weight is this rank's TP shard (dp and TP may both cut dim 0, a
    ``_StridedShard`` dp placement) and the scale covers the whole weight: the amax is all-reduced over the TP
    group(s) too."""
    local_rows = unsharded_local_shape(param, spec)[0]
    mesh, shard_group, rows, coordinate, replicas = spec.dp_mesh, None, (local_rows,), 0, []
    for dim, placement in enumerate(param.placements[: spec.dp_dims]):
        group = mesh.get_group(dim).group_name
        if placement.is_shard() or isinstance(placement, StridedShard):
            if placement.dim != 0:
                raise ValueError(f"float8 all-gather: expects dim-0 shards, got {param.placements}")
            rows, coordinate = tuple(chunk_rows(local_rows, mesh.size(dim))), mesh.get_local_rank(dim)
            shard_group = group
        else:
            replicas.append(group)
    tp_groups = () if spec.tp_mesh is None else tuple(
        spec.tp_mesh.get_group(dim).group_name for dim in range(spec.tp_mesh.ndim))
    return Float8Gather(shard_group, rows, coordinate, tuple(replicas), spec.mp_policy.param_dtype or param.dtype,
                        spec.mp_policy.reduce_dtype or param.dtype, module.linear_mm_config,
                        amax_groups=(() if shard_group is None else (shard_group,)) + tp_groups)


def enable_float8_all_gather(model: nn.Module) -> int:
    """Gather every tensorwise float8 linear's weight in float8 (after ``data_parallel``; on the meta model too).
    Each gets two buffers, not saved in checkpoints: ``float8_weight_scale`` and ``float8_weight_bits`` (its shard in
    float8: 1 byte per local element). Returns how many linears."""
    from torchao.float8.config import ScalingGranularity  # noqa: PLC0415 -- an optional dependency
    from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415

    count = 0
    for module in model.modules():
        specs = getattr(module, "_gather_specs", {})
        if not isinstance(module, Float8Linear) or "weight" not in specs:
            continue
        if module.config.cast_config_weight.scaling_granularity is not ScalingGranularity.TENSORWISE:
            raise ValueError("float8 all-gather needs tensorwise scaling (rowwise's backward scales the other axis)")
        param = module._parameters["weight"]
        specs["weight"] = dataclasses.replace(specs["weight"], float8=_float8_gather(module, param, specs["weight"]))
        device = param.device
        module.register_buffer(SCALE_BUFFER, torch.full((), math.nan, device=device), persistent=False)
        module.register_buffer(BITS_BUFFER, torch.empty(param.to_local().shape, dtype=torch.uint8, device=device),
                               persistent=False)
        count += 1
    return count


def float8_gathered_modules(parts: Iterable[nn.Module]) -> list[nn.Module]:
    return [m for part in parts for m in part.modules() if SCALE_BUFFER in m._buffers]


@torch.no_grad()
def refresh_float8_weights(parts: Iterable[nn.Module]) -> None:
    """Set every float8-gathered weight's scale from its current values, one all-reduce(max) per step over the shard
    group (and one over the TP group under tensor parallel; collectives: every rank of the groups calls it), and
    cast its shard with it into ``float8_weight_bits``. Call it whenever the weights changed (after the optimizer
    step or a checkpoint load) and before the forward: the trainer does it at the start of each step and of each
    validation. Casting once per step, not at each gather, also spares the backward's recomputed gathers the cast."""
    by_groups: dict[tuple[str, ...], list[nn.Module]] = {}
    for module in float8_gathered_modules(parts):
        by_groups.setdefault(module._gather_specs["weight"].float8.amax_groups, []).append(module)
    if not by_groups:  # no float8 gathers: a run without float8 never imports torchao (its import logs noise)
        return
    from torchao.float8.float8_utils import amax_to_scale  # noqa: PLC0415 -- an optional dependency
    for groups, modules in by_groups.items():
        shards = [m._parameters["weight"].to_local() for m in modules]
        dtypes = [m._gather_specs["weight"].float8.dtype for m in modules]
        # The amax of the weight as the linear would see it (in its gathered dtype); rounding is monotonic, so
        # that is the high-precision amax rounded once. An empty shard (uneven split) contributes 0.
        amax = torch.stack([torch.linalg.vector_norm(s, math.inf).to(d).float() if s.numel() else
                            s.new_zeros((), dtype=torch.float32) for s, d in zip(shards, dtypes, strict=True)])
        for group in groups:
            amax = wait_tensor(all_reduce(amax, "max", group))
        scales = amax_to_scale(amax, FLOAT8, modules[0].config.round_scales_to_power_of_2)
        for module, shard, dtype, scale in zip(modules, shards, dtypes, scales, strict=True):
            module._buffers[SCALE_BUFFER].copy_(scale)
            module._buffers[BITS_BUFFER].copy_(cast_shard(shard, scale, dtype))
