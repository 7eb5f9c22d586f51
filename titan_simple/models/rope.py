"""Rotary position embeddings as Llama 3 uses them: the frequency table, Llama 3.1's long-context scaling of it, and
the rotation of query / key channels (adjacent pairs, as Meta's checkpoints pair them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's long-context RoPE frequency scaling (Hugging Face's ``rope_scaling`` with ``rope_type "llama3"``).

    Rotations slower than ``original_context / low_freq_factor`` positions per turn are slowed ``factor`` times,
    those faster than ``original_context / high_freq_factor`` are kept, and the ones between are blended
    (``scale_rope_frequencies``). Llama 3.1 (8B, 70B, 405B) uses factor 8, Llama 3.2 (1B, 3B) factor 32.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192  # the context length the model was pretrained with before the extension
    type: str = "llama3"  # the only scaling Llama 3 models use

    def __post_init__(self) -> None:
        if self.type != "llama3":
            raise ValueError(f"RoPE scaling type {self.type!r} is not supported (Llama 3 uses 'llama3')")
        if self.factor <= 0 or self.original_context <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"impossible RoPE scaling {self}: factor and original_context must be positive and "
                             "high_freq_factor > low_freq_factor")


LLAMA31_ROPE = RopeScaling(factor=8.0)
LLAMA32_ROPE = RopeScaling(factor=32.0)


def scale_rope_frequencies(freqs: torch.Tensor, scaling: RopeScaling = LLAMA31_ROPE) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow rotations are interpolated ``factor`` times, fast ones are left alone.

    A frequency whose wavelength fits more than ``high_freq_factor`` times into the original context is
    kept; one whose wavelength is longer than ``original_context / low_freq_factor`` is divided by
    ``factor``; in between the two are blended linearly in ``original_context / wavelength``. The clamp
    expresses all three regions at once (blend weight 1 = keep, 0 = divide).
    """
    wavelength = 2 * math.pi / freqs
    keep_weight = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    keep_weight = keep_weight.clamp(0.0, 1.0)
    return (1 - keep_weight) * freqs / scaling.factor + keep_weight * freqs


def precompute_freqs_cis(
    head_dim: int, max_seq_len: int, theta: float = 500000.0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Unit complex numbers ``exp(i * position * freq)``, shape ``[max_seq_len, head_dim // 2]``, complex64.

    Computed in fp32 on the current default device (wrap in ``with torch.device(...)`` to choose).
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        freqs = scale_rope_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by position; ``freqs_cis`` is ``[seq, head_dim // 2]``.

    Adjacent channels ``(2j, 2j+1)`` form one complex number that is rotated by ``freqs_cis[t, j]``, the
    pairing of Meta's Llama checkpoints. The complex product is written out in real arithmetic because
    Inductor generates no code for complex operators; it runs in fp32 and the result is cast back.
    """
    # freqs_cis may also be given as its real view [seq, head_dim // 2, 2] (rows picked by position: Inductor
    # cannot index a complex tensor)
    cos_sin = (torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis).view(1, x.shape[1], 1, -1, 2)
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
