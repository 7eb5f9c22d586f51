"""Llama 3 weights in the Hugging Face ``transformers`` layout: names, RoPE permutation, config.json.

Our model and Meta's checkpoints rotate adjacent channels ``(2j, 2j+1)`` of each head as one complex number
(``llama3.apply_rotary_emb``). Hugging Face's ``LlamaAttention`` uses ``rotate_half``, which pairs channel
``j`` with channel ``j + head_dim / 2``. The two give the same attention scores if the rows of ``wq`` and
``wk`` are reordered within each head: interleaved row ``2j + c`` (c = 0 real, 1 imaginary) becomes
half-split row ``c * head_dim / 2 + j``. ``wv``, ``wo`` and everything else are copied unchanged.

Name mapping (ours -> Hugging Face)::

    tok_embeddings.weight                    model.embed_tokens.weight
    layers.N.attention.wq/wk/wv/wo.weight    model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.N.feed_forward.w1/w2/w3.weight    model.layers.N.mlp.gate_proj/down_proj/up_proj.weight
    layers.N.attention_norm.weight           model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight                 model.layers.N.post_attention_layernorm.weight
    norm.weight                              model.norm.weight
    output.weight                            lm_head.weight

A folder written by :func:`save_hf` holds ``config.json`` and ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when larger than the
shard size), which ``transformers.LlamaForCausalLM.from_pretrained`` reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import (
    ROPE_HIGH_FREQ_FACTOR,
    ROPE_LOW_FREQ_FACTOR,
    ROPE_ORIGINAL_CONTEXT,
    ROPE_SCALING_FACTOR,
    ModelArgs,
    ffn_hidden_dim,
)

_LAYER_NAMES = {  # ours (inside layers.N.) -> Hugging Face (inside model.layers.N.)
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_HF_LAYER_NAMES = {hf: ours for ours, hf in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {hf: ours for ours, hf in _TOP_NAMES.items()}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

DEFAULT_SHARD_BYTES = 5 * 1024**3


def to_hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face Llama name (``ValueError`` for a name Llama does not have)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER_KEY.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"no Hugging Face Llama name for parameter '{name}'")


def from_hf_name(name: str) -> str:
    """A Hugging Face Llama name -> ours (``ValueError`` for a name we do not know)."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    match = _HF_LAYER_KEY.match(name)
    if match and match.group(2) in _HF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{_HF_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"unknown Hugging Face Llama weight '{name}'")


def interleaved_to_half_split(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from our RoPE pairing to Hugging Face's (see module doc)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    # [head, j, c] -> [head, c, j]: row 2j + c moves to c * head_dim/2 + j.
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_split_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half_split`."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads_of(name: str, args: ModelArgs) -> int | None:
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One of our (full, unsharded) weights as ``(Hugging Face name, tensor)``."""
    heads = _heads_of(name, args)
    return to_hf_name(name), interleaved_to_half_split(tensor, heads) if heads else tensor


def from_hf_tensor(hf_name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One Hugging Face weight as ``(our name, tensor)``."""
    name = from_hf_name(hf_name)
    heads = _heads_of(name, args)
    return name, half_split_to_interleaved(tensor, heads) if heads else tensor


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with the shape of ``args``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": {
            "rope_type": "llama3", "factor": ROPE_SCALING_FACTOR, "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_HIGH_FREQ_FACTOR, "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT,
        } if args.rope_scaling else None,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_hf_config(folder: Path, args: ModelArgs) -> None:
    """Raise ConfigError naming every field of ``folder/config.json`` that does not fit ``args``."""
    path = folder / "config.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"Hugging Face weights {folder}: cannot read config.json ({e}).") from None
    expected = hf_config(args, torch.float32)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    wrong = [f"{k} {found.get(k)} (model: {expected[k]})" for k in keys if found.get(k) != expected[k]]
    if found.get("tie_word_embeddings"):
        wrong.append("tie_word_embeddings true (model: false)")
    if wrong:
        raise ConfigError(f"Hugging Face weights {folder} do not fit the model: {', '.join(wrong)}; "
                          "choose the matching [model] flavor.")


def is_hf_folder(path: str | Path) -> bool:
    folder = Path(path)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def save_hf(
    weights: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    args: ModelArgs,
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write our full (unsharded) weights as a Hugging Face Llama folder; return the folder.

    ``weights`` yields ``(our name, tensor)``; tensors are converted one at a time and written in shards of
    at most ``max_shard_bytes``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items = weights.items() if isinstance(weights, dict) else weights
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, tensor in items:
        hf_name, hf_tensor = to_hf_tensor(name, tensor.detach().to("cpu", dtype), args)
        size = hf_tensor.numel() * hf_tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][hf_name] = hf_tensor.contiguous()
        shard_bytes += size
        total_bytes += size
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    return folder


def _hf_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def load_hf(folder: str | Path, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(our name, full tensor)`` from a Hugging Face Llama folder, one tensor at a time.

    The config is checked first (ConfigError on a shape mismatch); unknown weight names raise ConfigError.
    """
    folder = Path(folder)
    check_hf_config(folder, args)
    for file in _hf_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name.endswith("rotary_emb.inv_freq"):  # older exports carry the RoPE table
                        continue
                    try:
                        yield from_hf_tensor(hf_name, f.get_tensor(hf_name), args)
                    except ValueError as e:
                        raise ConfigError(f"Hugging Face weights {file}: {e}.") from None
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"Hugging Face weights {file} cannot be read ({e}).") from None
