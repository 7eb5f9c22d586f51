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
    output.weight                            lm_head.weight (not written with tied embeddings)

``model_args_from_hf`` reads a folder's ``config.json`` as ``ModelArgs`` (``[model] hf_config``), and
``check_hf_config`` refuses weights whose config computes another function than the model they go into.

A folder written by :func:`save_hf` holds ``config.json`` and ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when larger than the
shard size), which ``transformers.LlamaForCausalLM.from_pretrained`` reads. Which files are a folder's weights, and
how an export replaces them whole, is ``hf_files.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_simple.errors import ConfigError
from titan_simple.models.hf_files import INDEX, WEIGHTS, weight_shapes, write_weight_set
from titan_simple.models.llama3 import LLAMA3_FLAVORS, ModelArgs, RopeScaling, Transformer

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


def _rope_scaling_json(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    return {"rope_type": scaling.type, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor, "original_max_position_embeddings": scaling.original_context}


# Meta's Llama 3.1 (factor 8) and 3.2 (factor 32) folders both declare 131072 positions: 16 x their original
# context of 8192, the length their long-context training reached, whatever the factor.
META_SCALED_CONTEXT_RATIO = 16


def hf_context(args: ModelArgs) -> int:
    """``max_position_embeddings`` to export: at least the trained length, and the one the model was imported with
    (``args.max_position_embeddings``, a Hugging Face folder's, carried through complete.json) when larger; without
    one, with scaled RoPE, at least Meta's value (16 x the original context: 131072 for Llama 3.1 and 3.2 alike)."""
    if args.max_position_embeddings:
        return max(args.max_position_embeddings, args.max_seq_len)
    if args.rope_scaling is None:
        return args.max_seq_len
    return max(args.max_seq_len, META_SCALED_CONTEXT_RATIO * args.rope_scaling.original_context)


def hf_config(args: ModelArgs, dtype: torch.dtype, special_tokens: dict[str, int] | None = None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``args`` computes.

    RoPE is written as ``rope_theta`` + ``rope_scaling``, the keys of Meta's published folders, which every
    ``transformers`` release reads (5.x converts them to its ``rope_parameters``). ``max_position_embeddings``:
    see :func:`hf_context`. ``special_tokens``: ``bos_token_id`` / ``eos_token_id`` of the tokenizer the model
    was trained with.
    """
    context = hf_context(args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling_json(args.rope_scaling),
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        **(special_tokens or {}),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def read_hf_config(path: str | Path) -> dict:
    """The ``config.json`` of a Hugging Face folder (or the file itself), or the one-line ConfigError."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"Hugging Face config {file} cannot be read ({e}).") from None


def _rope_from_hf(config: dict, where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either spelling: ``rope_theta`` + ``rope_scaling`` (Meta's folders,
    transformers 4.x) or ``rope_parameters`` (transformers 5.x). Missing keys take ``LlamaConfig``'s defaults."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict):
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        parameters, theta = config.get("rope_scaling") or {}, config.get("rope_theta", 10000.0)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"{where}: rope_scaling type '{kind}' is not Llama 3's ('llama3'); titan_simple builds "
                          "Llama 3 models only.")
    try:
        scaling = RopeScaling(factor=float(parameters["factor"]), low_freq_factor=float(parameters["low_freq_factor"]),
                              high_freq_factor=float(parameters["high_freq_factor"]),
                              original_context=int(parameters["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: its llama3 rope_scaling is incomplete or impossible ({e}).") from None
    return float(theta), scaling


def model_args_from_hf(config: dict, where: str, max_seq_len: int = 8192) -> ModelArgs:
    """The ``ModelArgs`` computing what a Hugging Face Llama ``config.json`` describes (``where`` names it in
    errors); ``max_seq_len``: the RoPE table to build. Anything that is not the Llama 3 architecture is one
    ConfigError line."""
    if config.get("model_type", "llama") != "llama":
        raise ConfigError(f"{where} describes a '{config.get('model_type')}' model; titan_simple builds Llama only.")
    unsupported = [f"{key} {config[key]!r}" for key, fine in (("hidden_act", "silu"), ("attention_bias", False),
                                                               ("mlp_bias", False)) if config.get(key, fine) != fine]
    if unsupported:
        raise ConfigError(f"{where}: {', '.join(unsupported)} is not the Llama 3 architecture (silu, no biases).")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in config]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; it is not a Llama config.json.")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // heads):
        raise ConfigError(f"{where}: head_dim {config['head_dim']} is not hidden_size / num_attention_heads = "
                          f"{dim // heads}, which Llama 3 needs.")
    theta, scaling = _rope_from_hf(config, where)
    try:
        return ModelArgs(
            dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
            ffn_hidden_size=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_seq_len=max_seq_len, max_position_embeddings=_declared_context(config),
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}.") from None


def _declared_context(config: dict) -> int | None:
    context = config.get("max_position_embeddings")
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def _describe_rope(scaling: RopeScaling | None) -> str:
    if scaling is None:
        return "none"
    return (f"llama3 factor {scaling.factor:g}, low {scaling.low_freq_factor:g}, high {scaling.high_freq_factor:g}, "
            f"original context {scaling.original_context}")


def function_fields(args: ModelArgs) -> dict[str, object]:
    """What of ``args`` changes the function a checkpoint computes, under the Hugging Face names: two models
    with equal fields compute the same logits from the same weights (the RoPE table's length aside)."""
    return {
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "intermediate_size": args.ffn_dim, "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta, "rope_scaling": _describe_rope(args.rope_scaling),
        "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_word_embeddings,
    }


def model_differences(found: ModelArgs, expected: ModelArgs, label: str = "model") -> list[str]:
    """``"key found (label: expected)"`` for each field of ``function_fields`` where the two differ."""
    theirs, ours = function_fields(found), function_fields(expected)
    return [f"{key} {theirs[key]} ({label}: {ours[key]})" for key in ours if theirs[key] != ours[key]]


def matching_flavors(args: ModelArgs) -> list[str]:
    """The flavors that compute what ``args`` computes."""
    return [name for name, flavor in LLAMA3_FLAVORS.items() if not model_differences(args, flavor)]


# The [model] keys that choose a model (config/schema.py), as complete.json records them (from_config.model_choice):
# hf_config (a resolved folder) or flavor, then the two overrides; None where unset.
MODEL_KEYS = ("hf_config", "flavor", "rope_scaling", "n_layers")
_OVERRIDDEN = {"rope_scaling": "rope_scaling", "n_layers": "num_hidden_layers"}  # override -> function field


def hf_folder_path(path: str | Path) -> str:
    """A Hugging Face folder named by itself or by its config.json, as one resolved path (for comparisons)."""
    path = Path(path).resolve()
    return str(path.parent if path.is_file() else path)


def model_changes(current: dict, target: dict, fields: list[str] | None = None) -> str:
    """The [model] settings that turn the ``current`` choice into ``target`` (both keyed by MODEL_KEYS; ``current``
    may be {}: unknown), e.g. ``--model.flavor debugmodel_tied and drop --model.rope_scaling none``; ``fields``
    (function_fields keys): drop only the overrides that change one of them. '' when nothing differs."""
    sets = [f"--model.{key} {target[key]}" for key in MODEL_KEYS
            if target.get(key) is not None and target.get(key) != current.get(key)]
    drops = [f"--model.{key} {current[key]}" for key in ("hf_config", "rope_scaling", "n_layers")
             if current.get(key) is not None and target.get(key) is None
             and (fields is None or _OVERRIDDEN.get(key) in fields)]
    if not drops:
        return " ".join(sets)
    return " ".join(sets) + (" and drop " if sets else "drop ") + ", ".join(drops)


def _hf_fix(folder: Path, found: ModelArgs, wrong: list[str], choice: dict | None) -> str:
    """How to build the model ``folder`` fits, never what the config already did (``choice``, see MODEL_KEYS)."""
    choice = choice or {}
    fields = [difference.split(" ", 1)[0] for difference in wrong]
    own = {"hf_config": hf_folder_path(folder)}
    drops = model_changes({**choice, "hf_config": own["hf_config"]}, own, fields)
    if choice.get("hf_config") == own["hf_config"] and drops:  # built from this folder: an override changes it
        return f"[model] hf_config already names this folder; {drops} (the override changes its model)"
    flavors = [name for name in matching_flavors(found) if name != choice.get("flavor")]
    other = f", or choose [model] flavor '{flavors[0]}'" if flavors else ""
    also = f" ({drops})" if drops else ""
    return f"Build the model from the folder with [model] hf_config = '{folder}'{also}{other}"


def check_hf_config(folder: Path, args: ModelArgs, model_name: str = "model", choice: dict | None = None) -> None:
    """Raise one ConfigError line naming every field of ``folder``'s config.json that changes the function
    from ``args`` (shapes, RoPE, norm epsilon, tied embeddings), and a fix that is not what ``choice`` (the
    config's [model] keys, see MODEL_KEYS) already did."""
    folder = Path(folder)
    found = model_args_from_hf(read_hf_config(folder), f"Hugging Face weights {folder}")
    wrong = model_differences(found, args, model_name)
    if wrong:
        raise ConfigError(f"Hugging Face weights {folder} do not fit {model_name}: {'; '.join(wrong)}. "
                          f"{_hf_fix(folder, found, wrong, choice)}.")


def _expected_weights(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The Hugging Face names and shapes of ``args``'s weights (a tied model has no ``lm_head.weight``)."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=1))  # the RoPE table is no weight
    return {to_hf_name(name): tuple(param.shape) for name, param in model.named_parameters()}


def _skipped(hf_name: str, args: ModelArgs) -> bool:
    """Weights some exports carry that the model does not load: the RoPE table of older exports, and with tied
    embeddings a ``lm_head.weight`` (the embedding is the output projection)."""
    return hf_name.endswith("rotary_emb.inv_freq") or (args.tie_word_embeddings and hf_name == "lm_head.weight")


def check_hf_folder(folder: str | Path, args: ModelArgs, model_name: str = "model",
                    choice: dict | None = None) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """All that can be checked of a Hugging Face folder before a model is built, each failure one ConfigError line:
    its config.json computes what ``args`` computes (:func:`check_hf_config`), it holds one whole, readable weight
    set (``hf_files.weight_shapes``: headers only) with every weight of the model, in its shape. Returns the
    weights as ``name -> (file, shape)``."""
    folder = Path(folder)
    check_hf_config(folder, args, model_name, choice)
    found = {name: where for name, where in weight_shapes(folder).items() if not _skipped(name, args)}
    expected = _expected_weights(args)
    problems = []
    for label, names in (("missing", sorted(set(expected) - set(found))),
                         ("unknown", sorted(set(found) - set(expected))),
                         ("of another shape", [f"{name} {list(found[name][1])} (model: {list(shape)})"
                                               for name, shape in expected.items()
                                               if name in found and found[name][1] != shape])):
        if names:
            problems.append(f"{len(names)} {label} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    if problems:
        raise ConfigError(f"Hugging Face weights {folder} are not the weights its config.json describes: "
                          f"{'; '.join(problems)}; download or export the folder again.")
    return found


def is_hf_folder(path: str | Path) -> bool:
    folder = Path(path)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def save_hf(
    weights: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    args: ModelArgs,
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    special_tokens: dict[str, int] | None = None,
) -> Path:
    """Write our full (unsharded) weights as a Hugging Face Llama folder; return the folder.

    ``weights`` yields ``(our name, tensor)``; tensors are converted one at a time and written in shards of
    at most ``max_shard_bytes``. A weight set already in ``folder`` is replaced whole, atomically, its other files
    kept (``hf_files.write_weight_set``); a folder holding a DCP checkpoint, or a file, is one ConfigError line.
    """
    config = hf_config(args, dtype, special_tokens)

    def write(target: Path) -> None:
        _write_shards(weights, args, target, dtype, max_shard_bytes)
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return write_weight_set(folder, write)


def _write_shards(weights: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], args: ModelArgs,
                  folder: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` and their index."""
    items = weights.items() if isinstance(weights, dict) else weights
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, tensor in items:
        if args.tie_word_embeddings and name == "output.weight":  # the embedding, written once (no lm_head)
            continue
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
        _save_shard(shards[0], folder / WEIGHTS, metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, folder / file, metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.save_file``, then the file's permissions any other file we write gets (it creates them 0600:
    the folder's other readers, a serving job, could not read the weights)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def load_hf(folder: str | Path, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(our name, full tensor)`` from a Hugging Face Llama folder, one tensor at a time.

    The folder is checked first, config and files (:func:`check_hf_folder`); a file that fails while its tensors
    are read is one ConfigError line too. With tied embeddings a ``lm_head.weight`` some exports carry is skipped:
    the embedding is the output projection.
    """
    folder = Path(folder)
    found = check_hf_folder(folder, args)
    for file in sorted({file for file, _ in found.values()}):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name in found:
                        yield from_hf_tensor(hf_name, f.get_tensor(hf_name), args)
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"Hugging Face weights {file} cannot be read ({e}); the file is truncated or corrupt: "
                              "download or export it again.") from None
