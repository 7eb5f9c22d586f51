"""Tensor parallel for Llama 3: Megatron-style sharded matmuls, sequence parallel and loss parallel.

Inside a block the activations alternate between two layouts on the TP mesh:

* **sequence-sharded** ``Shard(1)`` (``[batch, seq/tp, dim]`` per rank): the residual stream and the
  RMSNorms (``SequenceParallel``: the norm weight is replicated, each rank normalizes its tokens);
* **head/column-sharded**: ``PrepareModuleInput`` all-gathers the normalized input along the sequence
  (``Shard(1) -> Replicate``), ``wq``/``wk``/``wv`` and ``w1``/``w3`` (``ColwiseParallel``) produce this
  rank's heads / hidden columns, and ``wo``/``w2`` (``RowwiseParallel``) reduce-scatter their partial sums
  straight back to ``Shard(1)``.

So a block costs two all-gathers and two reduce-scatters of activations forward (and the same, transposed,
backward), and norms, residual adds and their activations are split ``tp`` ways. The embedding is
sharded by vocabulary rows (``RowwiseParallel``: a masked lookup whose partial sums are reduce-scattered to
``Shard(1)``); the output projection by vocabulary columns (``ColwiseParallel``). With **loss parallel**
its logits stay vocab-sharded (``Shard(-1)`` DTensor) and ``F.cross_entropy`` under
``torch.distributed.tensor.parallel.loss_parallel()`` computes the loss from the shards (all-reduces of
``[batch, seq]`` maxima and sums instead of an all-gather of ``[batch, seq, vocab]`` logits); the
``backward()`` must run inside the same context. Without it the logits are all-gathered to a plain tensor.

The residual stream is kept as a DTensor (``use_local_output=False`` on the modules that write to it), so
``Transformer.forward`` sees the global sequence length and slices the RoPE table ``freqs_cis`` (a plain
tensor, never sharded) for all of it: the model code needs no change. ``Attention`` derives the number of
local heads from the projected tensor.

Apply it first, on the meta model; activation checkpointing and SimpleFSDP then wrap the TP modules, and
SimpleFSDP rebuilds each TP DTensor parameter on the joint ``(dp, tp)`` mesh (``simple_fsdp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from titan_simple.parallel.float8_gloo import gather_float8_as_bytes

# The gathering property of SimpleFSDP, reused with zero data-parallel dimensions (keep_gradient_layouts).
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, _GatherSpec, _parametrize


def block_plan(block: nn.Module | None = None, float8: bool = False) -> dict[str, object]:
    """The plan of one ``TransformerBlock`` (module paths relative to the block). ``float8`` (tensorwise float8
    linears): where all of a sublayer's linears are float8, torchao's float8 styles, which cast the normalized
    input to float8 *before* its all-gather (a rank casts its sequence shard, not the gathered sequence, and the
    gather moves half the bytes) and the linears' output gradients before theirs."""
    plan = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis, mask): gather the normalized tokens; the RoPE table and the attention mask (None: causal)
        # pass through as they are (the mask's head dim is 1: it broadcasts over this rank's heads).
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if float8 and block is not None:
        plan.update(_float8_styles(block))
    return plan


def _float8_styles(block: nn.Module) -> dict[str, object]:
    """torchao's float8 styles for each sublayer of ``block`` whose linears are all float8 (a linear kept in high
    precision by ``[float8] filter_fqns`` keeps its sublayer on the plain styles)."""
    from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415 -- an optional dependency
    from torchao.float8.float8_tensor_parallel import (  # noqa: PLC0415
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    styles: dict[str, object] = {}
    for sublayer, colwise, rowwise, layouts in (
        ("attention", ("wq", "wk", "wv"), "wo", ((Shard(1), None, None), (Replicate(), None, None))),
        ("feed_forward", ("w1", "w3"), "w2", ((Shard(1),), (Replicate(),))),
    ):
        if not all(isinstance(block.get_submodule(f"{sublayer}.{n}"), Float8Linear) for n in (*colwise, rowwise)):
            continue
        styles[sublayer] = PrepareFloat8ModuleInput(input_layouts=layouts[0], desired_input_layouts=layouts[1],
                                                    fwd_config_submodule_fqn=colwise[0])
        styles.update({f"{sublayer}.{n}": Float8ColwiseParallel() for n in colwise})
        styles[f"{sublayer}.{rowwise}"] = Float8RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return styles


def local_linear_shape(tp: int) -> Callable[[str, int, int], tuple[int, int]]:
    """``(linear's name, in_features, out_features) -> (in, out)`` of its shard on one of ``tp`` ranks: the plan's
    row-parallel linears split their input features, every other linear (column-parallel, the output projection
    too) its output features. What a float8 matmul must find aligned (``models/float8.float8_targets``)."""
    row_parallel = {name for name, style in block_plan().items() if isinstance(style, RowwiseParallel)}

    def local(name: str, in_features: int, out_features: int) -> tuple[int, int]:
        if name.split(".", 2)[-1] in row_parallel:  # layers.N.<name in the block>
            return in_features // tp, out_features
        return in_features, out_features // tp

    return local


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, float8: bool = False
                          ) -> nn.Module:
    """Shard a Llama 3 ``Transformer`` over the 1-D ``tp_mesh`` in place (and return it).

    Parameters become DTensors on ``tp_mesh`` (``Shard(0)`` for column-parallel weights and the embedding,
    ``Shard(1)`` for row-parallel ones, ``Replicate()`` for norms); their names do not change. A model on
    the meta device stays there: ``to_empty`` and ``init_weights`` it afterwards (under
    ``sharded_init.layout_invariant_init()`` to get the single-process values). A pipeline stage whose
    ``tok_embeddings`` / ``norm`` / ``output`` are ``None`` is handled (those entries are skipped).

    ``loss_parallel``: the model returns vocab-sharded logits (a ``Shard(-1)`` DTensor) for
    ``F.cross_entropy`` under ``loss_parallel_context(True)``; otherwise plain, full logits. ``float8``: tensorwise
    float8 linears get torchao's float8 styles (``block_plan``).
    """
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
        # Both shard the vocabulary (the embedding's rows, the output's columns: Shard(0) of either weight), so a
        # tied weight, which parallelize_module gave each module a copy of, is one parameter again.
        model.tie_weights()
    if float8 and dist.get_backend(tp_mesh.get_group()) == "gloo":
        gather_float8_as_bytes()  # gloo has no float8 type
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, float8))
    return model


def keep_gradient_layouts(model: nn.Module) -> nn.Module:
    """With tensor parallel alone (no data parallel wrapper), make every gradient arrive in its parameter's
    layout; call it after ``apply_tensor_parallel``.

    DTensor's backward leaves some gradients in another layout than their parameter: a replicated norm
    weight used on sequence shards gets a ``Partial`` gradient (each rank's sum over its own tokens), the
    vocab-sharded embedding a ``Replicate`` one. Clipping and the optimizer would then reduce them again
    at every use. Here each parameter is read through SimpleFSDP's gathering property with no dp
    dimensions: ``DTensor.from_local(param.to_local(), tp_mesh, placements)``, a no-op forward whose
    backward redistributes the gradient to ``placements`` (an all-reduce of the norm gradients). SimpleFSDP
    and FSDP2 do this themselves; don't combine them with this function. Read the parameters through
    module attributes under ``simple_fsdp.sharded_parameters()`` (e.g. ``init_weights``), as with SimpleFSDP.
    """
    for module in list(model.modules()):
        specs = {
            name: _GatherSpec(0, MixedPrecisionPolicy(), param.device_mesh, param.device_mesh, tuple(param.placements))
            for name, param in module.named_parameters(recurse=False)
            if isinstance(param, DTensor)
        }
        if specs:
            _parametrize(module, specs)
    return model


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when ``enabled`` (vocab-sharded logits), else a no-op. Wrap the loss *and* its
    ``backward()`` in it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
