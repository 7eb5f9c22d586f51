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
back to the math kernel (checked, docs/research/issue47_long_context.md), but it cannot skip the masked blocks
and holds ``B * T * T`` bytes of mask. ``attention = "flex"`` (CUDA only: torch 2.13's FlexAttention has no
backward on CPU): the same predicate as FlexAttention's sparse ``BlockMask`` and a compiled ``flex_attention``,
which skips the blocks no query of a tile may see. The flex path has not run here (no GPU in this project's
sessions so far); ``scripts/gpu_session.sh`` is where a GPU session checks it against the SDPA path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titan_simple.errors import ConfigError

KERNELS = ("sdpa", "flex")
MASKS = ("causal", "block_causal")

Mask = torch.Tensor | BlockMask  # what the blocks hand the attention: None means causal


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


def flex_block_mask(ids: torch.Tensor | None, positions: torch.Tensor | None = None,
                    key_positions: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention's block-sparse mask (CUDA): the predicate of ``block_causal_mask`` / ``position_mask``,
    evaluated block by block by a compiled ``create_block_mask``."""

    def allowed(b, h, q_idx, kv_idx):
        q = q_idx if positions is None else positions[b, q_idx]
        k = kv_idx if key_positions is None else key_positions[b, kv_idx]
        return (q >= k) if ids is None else (q >= k) & (ids[b, q] == ids[b, k])

    rows = ids if positions is None else positions
    q_len = rows.shape[1]
    kv_len = q_len if key_positions is None else key_positions.shape[1]
    return _compiled_create_block_mask()(allowed, rows.shape[0], None, q_len, kv_len, device=rows.device)


def attention_mask(kernel: str, ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                   key_positions: torch.Tensor | None = None) -> Mask | None:
    """The mask the blocks share for a forward, in ``kernel``'s form: None (SDPA's ``is_causal``) for causal
    attention over the row's own tokens in order; block-causal with document ids; by position when the keys are
    gathered from other ranks (``key_positions``, context parallel)."""
    if key_positions is None:
        if ids is None:
            return None
        return flex_block_mask(ids) if kernel == "flex" else block_causal_mask(ids)
    if kernel == "flex":
        return flex_block_mask(ids, positions, key_positions)
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

    def model_kwargs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for a batch of ``tokens`` besides the tokens: none for causal attention (the
        call every layout has always compiled), the document ids for block-causal."""
        if self.mask != "block_causal" or self.eos_id is None:
            return {}
        return {"document_ids": document_ids(tokens, self.eos_id)}

    def describe(self) -> str:
        mask = f"block-causal (documents end at EOS id {self.eos_id})" if self.mask == "block_causal" else "causal"
        return f"attention: {mask}, {self.kernel}"
