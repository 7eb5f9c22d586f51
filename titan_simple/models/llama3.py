"""The Llama 3 decoder-only transformer, its size presets, initialization and FLOP accounting.

Written so the parallelisms can be applied from outside without touching this file:

* ``layers`` is an ``nn.ModuleDict`` keyed ``"0".."n-1"``: pipeline parallel deletes the layers a stage does
  not own and sets ``tok_embeddings`` / ``norm`` / ``output`` to ``None``, and the surviving parameters keep
  their full-model names (``layers.3.attention.wq.weight``), so checkpoints line up across layouts.
* ``Attention`` reads the number of heads from the projected tensor, not from ``ModelArgs``, so it runs
  unchanged when tensor parallel gives ``wq`` / ``wk`` / ``wv`` only a slice of the heads.
* The model can be built on the meta device and initialized after sharding: ``init_weights`` uses only the
  in-place ``torch.nn.init`` functions, which also work on DTensor parameters.
* Nothing here names a parallelism; they swap a module's class for a subclass that overrides one method:
  ``Attention.attend`` (context parallel gathers the keys and values first), ``Transformer.forward_modules``
  (regional compilation runs compiled regions). Everything the attention takes besides the tokens is one argument,
  ``models/attention.AttentionInputs``.

Usage::

    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS["8B"])
    # ... shard / parallelize ...
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_simple.errors import ConfigError
from titan_simple.models.attention import (
    CAUSAL,
    AttentionInputs,
    KVCache,
    Mask,
    attention_mask,
    flex,
    is_block_mask,
)
from titan_simple.models.rope import LLAMA31_ROPE, LLAMA32_ROPE, RopeScaling, apply_rotary_emb, precompute_freqs_cis

# Standard deviation of the input projections (and the base of the depth-scaled output projections).
INIT_STD = 0.02

@dataclass
class ModelArgs:
    """Shape and hyper-parameters of a Llama 3 model."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None  # scales the SwiGLU hidden size before rounding
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None  # None: Llama 3.0's plain RoPE
    tie_word_embeddings: bool = False  # the output projection is the token embedding (Llama 3.2 1B and 3B)
    ffn_hidden_size: int | None = None  # the SwiGLU width as given (a Hugging Face config); None: from the rule
    max_seq_len: int = 8192  # length of the precomputed RoPE table, i.e. the longest sequence the model takes
    depth_init: bool = True  # output projections of deeper layers start smaller (see TransformerBlock)
    # The context a Hugging Face config.json declared (its max_position_embeddings), kept for the export to write
    # back. It changes nothing the model computes: it is left out of repr() (which names the compiled graphs) and
    # of equality (flavor comparisons); complete.json records it (dataclasses.asdict).
    max_position_embeddings: int | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as dataclasses.asdict wrote it (a checkpoint's complete.json)
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        elif isinstance(self.rope_scaling, bool):  # checkpoints saved before the scaling had parameters
            self.rope_scaling = LLAMA31_ROPE if self.rope_scaling else None
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU hidden width."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # Small enough to train on CPUs in seconds. Heads (16 query, 8 KV), the SwiGLU width (768) and the
    # vocabulary (2000) all divide by 2, 4 and 8, so every tensor-parallel degree up to 8 shards evenly.
    # vocab_size matches the 2k-token Shakespeare BPE (special tokens included); any tokenizer with at
    # most 2000 ids fits, the unused rows are simply never looked up.
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2000, multiple_of=256, rope_theta=500000.0
    ),
    # A little heavier, for benchmarks where the debug model is dominated by overheads.
    "debugmodel_large": ModelArgs(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=2000, multiple_of=256, rope_theta=500000.0
    ),
    # The debug model shaped like Llama 3.2: tied embeddings and factor-32 RoPE scaling.
    "debugmodel_tied": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2000, multiple_of=256, rope_theta=500000.0,
        rope_scaling=LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    # Llama 3.2 as Meta publishes it (text models): tied embeddings, RoPE scaled 32x.
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=256, ffn_dim_multiplier=1.5, rope_scaling=LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
        multiple_of=256, ffn_dim_multiplier=1.0, rope_scaling=LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    # Llama 3.1 as Meta publishes it: the shapes of Llama 3, RoPE scaled 8x for the 128K context.
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=1024, ffn_dim_multiplier=1.3, rope_scaling=LLAMA31_ROPE,
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.3, rope_scaling=LLAMA31_ROPE,
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.2, rope_scaling=LLAMA31_ROPE,
    ),
}


# ---------------------------------------------------------------------------------------------- modules


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    # torch's default cut-off is +-2 in absolute value, i.e. ~100 std here: in effect a normal(0, std).
    nn.init.trunc_normal_(weight, mean=0.0, std=std)


def _grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None = None
) -> torch.Tensor:
    """Causal attention over ``[batch, heads, seq, head_dim]``; ``k``/``v`` may have fewer heads than ``q``.

    ``mask`` (boolean, True = may attend, broadcastable to ``[batch, 1, q_seq, k_seq]``) replaces the causal
    mask: block-causal masks (``models/attention.py``) and decoding with a ``KVCache``, whose keys include
    earlier positions than the queries. A FlexAttention ``BlockMask`` runs FlexAttention instead of SDPA.

    SDPA's ``enable_gqa`` avoids materializing the repeated KV heads, but on CUDA only the flash kernel
    (fp16/bf16, no mask) supports it; elsewhere it would fall back to the memory-hungry math kernel. So fp32 on
    CUDA, and any mask on CUDA, repeats the KV heads explicitly and keeps the memory-efficient kernel available.
    """
    if is_block_mask(mask):
        return flex(q, k, v, mask)
    causal = {"is_causal": True} if mask is None else {"attn_mask": mask}
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, **causal)
    if q.device.type == "cuda" and (mask is not None or q.dtype not in (torch.float16, torch.bfloat16)):
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **causal)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **causal)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped-query KV heads and rotary position embeddings."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None = None,
        cache: KVCache | None = None, layer: str = "",
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallel each projection holds only this rank's heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        return self.wo(self.attend(q, k, v, mask, cache, layer))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None = None,
               cache: KVCache | None = None, layer: str = "") -> torch.Tensor:
        """The attention kernel: queries, keys and values ``[batch, seq, heads, head_dim]`` (rotated) -> ``[batch,
        seq, heads * head_dim]``. A method of its own so that a parallelism can swap it (context parallel's
        subclass, ``parallel/context_parallel.py``, gathers the keys and values of the whole sequence first)."""
        batch, seq_len = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [batch, heads, seq, head_dim]
        if cache is not None:  # attend to the cached positions too
            mask = cache.mask(seq_len, q.device)
            k, v = cache.update(layer, k, v)
        out = _grouped_query_attention(q, k, v, mask)
        return out.transpose(1, 2).reshape(batch, seq_len, -1)

    def init_weights(self, out_init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal_(linear.weight, INIT_STD)
        _trunc_normal_(self.wo.weight, out_init_std)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width: 2/3 of 4*dim (three matrices cost what two 4*dim ones would), scaled, rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``; ``w1``/``w3`` shard by columns, ``w2`` by rows under TP."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_init_std: float) -> None:
        _trunc_normal_(self.w1.weight, INIT_STD)
        _trunc_normal_(self.w2.weight, out_init_std)
        _trunc_normal_(self.w3.weight, out_init_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # Projections that write into the residual stream start smaller so the stream's variance does not
        # grow with depth: by layer index (depth_init) or uniformly by the total number of layers.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = INIT_STD / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        # Training passes exactly (x, freqs_cis, mask): tensor parallel's PrepareModuleInput on `attention` expects
        # three inputs and raises "module inputs and input_layouts should have same length" on five.
        normed = self.attention_norm(x)
        if cache is None:
            h = x + self.attention(normed, freqs_cis, mask)
        else:
            h = x + self.attention(normed, freqs_cis, None, cache, str(self.layer_id))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.feed_forward.init_weights(self.out_init_std)


class Transformer(nn.Module):
    """Llama 3: token embedding, ``n_layers`` blocks, final RMSNorm and an output projection (the embedding
    itself with ``tie_word_embeddings``: one parameter, reached under both names).

    ``forward(tokens[B, T], attention_inputs=None) -> logits[B, T, vocab]``; with a ``KVCache`` in the attention
    inputs (generation) the tokens are the ones after the cached positions, and the cache advances by ``T``. The
    model holds no parallelism: they swap its modules' classes (SimpleFSDP, activation checkpointing, context
    parallel, regional compilation) or hook them (tensor parallel). A pipeline stage may set
    ``tok_embeddings`` (then the input is hidden states ``[B, T, dim]``) and/or ``norm`` and ``output`` to
    ``None`` (then it returns hidden states), and may delete entries of ``layers``.
    """

    def __init__(self, args: ModelArgs, attention: str = "sdpa") -> None:
        super().__init__()
        self.args = args
        self.attention_kernel = attention  # sdpa or flex (models/attention.py): how, not what, the model computes
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Not persistent: it is a pure function of args, so checkpoints neither store nor need it. Keep it
        # complex64: model.to(<real dtype>) would drop its imaginary part (init_weights recomputes it).
        self.register_buffer(
            "freqs_cis", torch.empty(args.max_seq_len, args.head_dim // 2, dtype=torch.complex64),
            persistent=False,
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()  # on the meta device this costs nothing and fills nothing

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make ``output.weight`` the very parameter of ``tok_embeddings``.

        Whatever replaces parameters module by module (``to_empty``, tensor parallel's ``parallelize_module``)
        unties them; call this again after it (``to_empty`` below does). A pipeline stage holding only one of
        the two has nothing to tie.
        """
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output._parameters["weight"] = self.tok_embeddings._parameters["weight"]

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()  # to_empty gives every module a parameter of its own
        return self

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter and recompute the RoPE table.

        Call after ``to_empty()`` when the model was built on the meta device (``to_empty`` leaves the
        buffer uninitialized too). ``buffer_device`` defaults to where the buffer is now.
        """
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = precompute_freqs_cis(
                self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.args.rope_scaling
            )
        if self.tok_embeddings is not None and not self.args.tie_word_embeddings:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:  # a tied embedding starts as the output projection: its logits set the scale
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, attention_inputs: AttentionInputs | None = None) -> torch.Tensor:
        """``tokens`` ``[B, T]`` (or a pipeline stage's input ``[B, T, dim]``); ``attention_inputs``
        (``models/attention.AttentionInputs``): document ids, positions, the keys' positions, the generation
        cache; None is causal attention over rows at positions ``0..T-1``."""
        inputs = attention_inputs if attention_inputs is not None else CAUSAL
        freqs_cis = self._rotary_table(tokens, inputs)
        mask = attention_mask(self.attention_kernel, tokens.shape[0], tokens.shape[1], tokens.device,
                              inputs.document_ids, inputs.positions, inputs.key_positions)
        h = self.forward_modules(tokens, freqs_cis, mask, inputs.cache)
        if inputs.cache is not None:
            inputs.cache.position += tokens.shape[1]
        return h

    def _rotary_table(self, tokens: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """The RoPE rows of the tokens' positions; checks the rows fit the table (and the cache)."""
        cache = inputs.cache
        start = 0 if cache is None else cache.position
        end = start + tokens.shape[1]
        if inputs.key_positions is not None:  # context parallel: this rank holds a share of rows of that length
            end = inputs.key_positions.shape[1]
        if end > self.freqs_cis.shape[0]:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {self.freqs_cis.shape[0]}")
        if cache is not None and end > cache.max_len:
            raise ValueError(f"sequence length {end} exceeds the KV cache's max_len {cache.max_len}")
        if inputs.positions is None:
            return self.freqs_cis[start:end]
        return torch.view_as_real(self.freqs_cis)[inputs.positions[0]]  # every row holds the same positions

    def forward_modules(self, tokens: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None,
                        cache: KVCache | None = None) -> torch.Tensor:
        """The embedding, the blocks, the final norm and the output projection (those this model or stage has),
        given the RoPE rows and the mask every block shares. Regional compilation's class (``compile/regions.py``)
        runs them as compiled regions instead."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            # Training calls layer(h, freqs_cis, mask); the cache is only passed when there is one.
            h = layer(h, freqs_cis, mask) if cache is None else layer(h, freqs_cis, cache=cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


# ---------------------------------------------------------------------------------------------- helpers


def count_parameters(model: nn.Module | ModelArgs, exclude_embedding: bool = False) -> int:
    """Number of parameters; works on meta models, and counts DTensor parameters at their global size. A
    ``ModelArgs`` is counted from its shapes alone (a model on the meta device, no storage).

    ``exclude_embedding`` leaves out the token embedding (a lookup, no FLOPs) but keeps the output
    projection, the convention of ``flops_per_token``; a tied one is counted once, as the output projection.
    """
    if isinstance(model, ModelArgs):
        with torch.device("meta"):
            model = Transformer(model)
    total, seen = 0, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if (exclude_embedding and "tok_embeddings" in name.split(".")) or id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()  # a DTensor reports its global numel
    return total


def flops_per_token(args: ModelArgs, num_params_non_embedding: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the dense model: ``6 N + 12 L H d T``.

    * ``6 N``: every weight is used in one multiply-add (2 FLOPs) forward and two backward (input and
      weight gradients). ``N`` excludes the token embedding (a gather, not a matmul) and includes the output
      projection (a real matmul), as ``count_parameters(model, exclude_embedding=True)`` returns.
    * ``12 L H d T``: attention scores ``Q K^T`` and the weighted sum ``A V``, 2 FLOPs x ``T`` x ``H d``
      each per token and layer, times 3 for forward + backward. The full ``T x T`` score matrix is
      counted, although causal kernels skip about half of it (the usual MFU convention).

    ``L`` layers, ``H`` query heads, ``d`` head dimension, ``T`` sequence length.
    """
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * num_params_non_embedding + attention)


def build_model(
    flavor: str,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    device: torch.device | str = "meta",
    n_layers: int | None = None,
) -> Transformer:
    """Build a flavor from ``LLAMA3_FLAVORS``, optionally overriding its vocabulary, RoPE table length and
    depth.

    On the meta device the result holds no storage: ``to_empty`` and ``init_weights`` it after
    parallelizing. On a real device it comes back initialized.
    """
    if flavor not in LLAMA3_FLAVORS:
        raise ConfigError(
            f"[model] flavor '{flavor}' is unknown; choose one of: {', '.join(LLAMA3_FLAVORS)}."
        )
    overrides: dict[str, int] = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    if n_layers is not None:
        overrides["n_layers"] = n_layers
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], **overrides)
    with torch.device(device):
        return Transformer(args)
