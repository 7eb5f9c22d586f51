"""Which earlier tokens a query may attend to (causal or block-causal), and the kernel that applies it.

**Causal**: every earlier token of the sequence; SDPA's ``is_causal``, what the model has always run.

**Block-causal** (document masking, as Llama 3 was pretrained): the data packs documents, each framed ``BOS text
EOS`` (``data/token_store.py``), into sequences that cross their boundaries; a token attends only to earlier tokens
of its own document. A token's document is the number of EOS tokens strictly before it in its row, so an EOS
belongs to the document it closes, the token after it starts the next one, and a window that starts inside a
document starts with document 0. The EOS's own label is the next document's BOS; it is trained as any other
target (as TorchTitan does). RoPE positions stay the window's (not restarted per document).

**Kernels.** ``attention = "sdpa"`` (CPU and CUDA): block-causal is SDPA with a dense boolean mask
``[B, 1, Tq, Tk]``, built once per forward and shared by every block; the CPU flash kernel takes it without falling
back to the math kernel (checked, docs/research/issue47_long_context.md), CUDA's memory-efficient kernel with the
KV heads repeated (CUDA's flash kernel takes no mask); neither skips the masked blocks, and the mask holds
``B * T * T`` bytes. ``attention = "flex"`` (CUDA only: torch 2.13's FlexAttention has no backward on CPU): the
same predicate (``mask_mod``) as FlexAttention's sparse ``BlockMask``, for causal attention too, and a compiled
``flex_attention``, which skips the blocks no query of a tile may see. The flex path has not trained here (no
GPU in this project's sessions since); ``scripts/gpu_session.sh long_context`` checks it against the SDPA path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titan_simple.errors import ConfigError

KERNELS = ("sdpa", "flex")
MASKS = ("causal", "block_causal")

Mask = torch.Tensor | BlockMask  # what the blocks hand the attention: None means causal


class CacheShape(Protocol):
    """What a :class:`KVCache` reads of the model's arguments (``models/llama3.ModelArgs``)."""

    n_layers: int
    n_kv_heads: int

    @property
    def head_dim(self) -> int: ...


class KVCache:
    """Keys and values of the positions already seen, per layer, so generation feeds only the new tokens.

    Used for sampling only; training passes no cache and runs exactly the code it always ran.
    ``Transformer.forward(tokens, AttentionInputs(cache=cache))`` reads the rotary positions from ``position``,
    each attention layer appends its new keys/values (``update``), and the forward then advances ``position``.
    Buffers are ``[batch, kv_heads, max_len, head_dim]`` (SDPA's layout), allocated once.
    """

    def __init__(
        self, args: CacheShape, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        shape = (batch_size, args.n_kv_heads, max_len, args.head_dim)
        self.keys = {str(i): torch.zeros(shape, device=device, dtype=dtype) for i in range(args.n_layers)}
        self.values = {str(i): torch.zeros(shape, device=device, dtype=dtype) for i in range(args.n_layers)}
        self.max_len = max_len
        self.position = 0  # number of positions filled

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of the new positions for ``layer``; return the keys/values of all positions."""
        end = self.position + k.shape[2]
        self.keys[layer][:, :, self.position : end] = k
        self.values[layer][:, :, self.position : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """``[seq_len, position + seq_len]``: new query ``i`` (at ``position + i``) sees keys up to itself."""
        query_positions = torch.arange(self.position, self.position + seq_len, device=device)
        key_positions = torch.arange(self.position + seq_len, device=device)
        return key_positions[None, :] <= query_positions[:, None]


@dataclass(frozen=True)
class AttentionInputs:
    """What the model's attention needs besides the tokens: ``Transformer.forward(tokens, attention_inputs)``.
    Every field None (or no ``attention_inputs`` at all): causal attention over rows at positions ``0..T-1``, the
    call training has always compiled. One argument, so that the model's signature stays put as inputs are added.

    Pipeline schedules split a stage's keyword inputs into microbatches with pytree (registered below): each tensor
    field is cut along dim 0 like the tokens, the cache is passed whole."""

    # [B, T] (``document_ids``): block-causal attention instead of causal; under context parallel, of the whole rows.
    document_ids: torch.Tensor | None = None
    # [B, T]: where the tokens are in their rows (RoPE and the mask), when not 0..T-1 (every row holds the same).
    positions: torch.Tensor | None = None
    # [B, T_keys]: the positions of the keys each attention gathers (context parallel, in gather order).
    key_positions: torch.Tensor | None = None
    # Generation: the keys and values of the positions already seen; the tokens are the ones after them.
    cache: KVCache | None = None


CAUSAL = AttentionInputs()  # what no ``attention_inputs`` means
torch.export.register_dataclass(AttentionInputs)  # public pytree registration (torch.export's), for the schedules


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, T]`` int32: for each token, how many EOS tokens come strictly before it in its row."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def block_causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean ``attn_mask`` ``[B, 1, T, T]`` (True: may attend) for document ids ``[B, T]``."""
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return (ids[:, None, :, None] == ids[:, None, None, :]) & causal


def position_mask(positions: torch.Tensor, key_positions: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """SDPA's boolean mask ``[B, 1, Tq, Tk]`` for queries at ``positions`` ``[B, Tq]`` and keys at
    ``key_positions`` ``[B, Tk]`` (context parallel): causal by position, and within a document when the whole
    rows' ``ids`` are given."""
    allowed = key_positions[:, None, :] <= positions[:, :, None]
    if ids is not None:
        allowed = allowed & (ids.gather(1, positions)[:, :, None] == ids.gather(1, key_positions)[:, None, :])
    return allowed[:, None]


def mask_mod(ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             key_positions: torch.Tensor | None = None) -> Callable:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``: the predicate ``block_causal_mask`` / ``position_mask``
    evaluate densely. Causal by index, or by ``positions`` / ``key_positions`` when the keys are gathered (context
    parallel); within a document when ``ids`` (the whole rows') are given."""

    def allowed(b, h, q_idx, kv_idx):
        q = q_idx if key_positions is None else positions[b, q_idx]
        k = kv_idx if key_positions is None else key_positions[b, kv_idx]
        return (q >= k) if ids is None else (q >= k) & (ids[b, q] == ids[b, k])

    return allowed


def attention_mask(kernel: str, batch: int, length: int, device: torch.device, ids: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None) -> Mask | None:
    """The mask the blocks share for a forward of ``batch`` rows of ``length`` tokens, in ``kernel``'s form. SDPA:
    None (its ``is_causal``) for causal attention over the row's own tokens, a boolean mask for block-causal or
    for keys gathered from other ranks (``key_positions``, context parallel). Flex: always a block mask (a
    compiled ``create_block_mask``; one for every row where the mask differs by row)."""
    if kernel == "flex":
        kv_length = length if key_positions is None else key_positions.shape[1]
        rows = batch if ids is not None or key_positions is not None else None
        return _compiled_create_block_mask()(mask_mod(ids, positions, key_positions), rows, None, length, kv_length,
                                             device=device)
    if key_positions is None:
        return None if ids is None else block_causal_mask(ids)
    return position_mask(positions, key_positions, ids)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention over ``[batch, heads, seq, head_dim]`` with grouped KV heads, compiled (eager FlexAttention
    materializes every score)."""
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask, dynamic=False)


def check_attention_kernel(kernel: str, device_type: str, context_parallel: int = 1) -> None:
    """FlexAttention trains only on CUDA in this torch; context parallel on CUDA runs FlexAttention, whose block
    mask skips what a query may not see (SDPA would hold a dense ``[seq / cp, seq]`` mask per row: 2 GiB at 128K
    tokens over 8 ranks)."""
    if kernel == "flex" and device_type != "cuda":
        raise ConfigError(f"[model] attention = 'flex' needs a CUDA GPU (this run is on {device_type}): torch "
                          f"{torch.__version__}'s FlexAttention has no backward on CPU; use attention = 'sdpa', which "
                          "runs both masks.")
    if kernel != "flex" and device_type == "cuda" and context_parallel > 1:
        raise ConfigError(f"[parallelism] context_parallel_degree = {context_parallel} on CUDA needs [model] attention "
                          "= 'flex' (a block-sparse mask of this rank's queries against the gathered keys); SDPA is "
                          "the context-parallel kernel on CPU only.")


def is_block_mask(mask: object) -> bool:
    return isinstance(mask, BlockMask)


@dataclass(frozen=True)
class AttentionPlan:
    """The run's attention (``core/plan.plan_attention``): the kernel, the mask, and for block-causal the token
    that ends a document (None in a dry run, which prices the mask as causal: an upper bound of its work)."""

    kernel: str = "sdpa"
    mask: str = "causal"
    eos_id: int | None = None

    def inputs(self, tokens: torch.Tensor) -> AttentionInputs | None:
        """The model's attention inputs for a batch of ``tokens``: None for causal attention (the call every layout
        has always compiled), the document ids for block-causal."""
        if self.mask != "block_causal" or self.eos_id is None:
            return None
        return AttentionInputs(document_ids=document_ids(tokens, self.eos_id))

    def describe(self) -> str:
        ends = (f"EOS id {self.eos_id}" if self.eos_id is not None else
                "the tokenizer's EOS, which a dry run does not read: it prices the mask as causal")
        mask = f"block-causal (documents end at {ends})" if self.mask == "block_causal" else "causal"
        return f"attention: {mask}, {self.kernel}"
