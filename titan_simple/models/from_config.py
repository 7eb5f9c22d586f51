"""The model a job config describes -- a flavor, or a Hugging Face folder's config.json (``[model] hf_config``) --
and the checks that need only the config and the files it names, run while the plan is resolved
(``core/plan.py``), before anything is built."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.models.hf_files import refuse_other_weight_formats
from titan_simple.models.hf_llama import (
    check_hf_folder,
    hf_folder_path,
    is_hf_folder,
    model_args_from_hf,
    read_hf_config,
)
from titan_simple.models.llama3 import LLAMA3_FLAVORS, ModelArgs, build_model


def model_args_for(config: JobConfig, max_seq_len: int | None = None) -> ModelArgs:
    """The model the config describes: ``[model] hf_config``'s (a Hugging Face folder's config.json) or the
    flavor's, with ``rope_scaling = "none"`` applied, a RoPE table of ``max_seq_len`` (default ``[training]
    seq_len``) and ``[model] n_layers`` blocks when set; or the one-line error naming the known flavors."""
    model, seq_len = config.model, max_seq_len or config.training.seq_len
    if model.hf_config:
        where = f"[model] hf_config {model.hf_config}"
        if not Path(model.hf_config).exists():
            raise ConfigError(f"{where} does not exist; give a Hugging Face folder (or its config.json).")
        args = model_args_from_hf(read_hf_config(model.hf_config), where, max_seq_len=seq_len)
    else:
        if model.flavor not in LLAMA3_FLAVORS:
            build_model(model.flavor)  # raises the unknown-flavor ConfigError
        args = dataclasses.replace(LLAMA3_FLAVORS[model.flavor], max_seq_len=seq_len)
    if model.rope_scaling == "none":  # another context than the folder declares: the export works it out again
        args = dataclasses.replace(args, rope_scaling=None, max_position_embeddings=None)
    return dataclasses.replace(args, n_layers=model.n_layers) if model.n_layers else args


def model_name(config: JobConfig) -> str:
    """How messages name the model: ``flavor 8B`` or ``hf_config <folder>``."""
    return f"hf_config {config.model.hf_config}" if config.model.hf_config else f"flavor {config.model.flavor}"


def model_choice(config: JobConfig) -> dict[str, object]:
    """The [model] keys that chose the model (``hf_llama.MODEL_KEYS``): ``hf_config`` as a resolved folder, else
    ``flavor``, and the ``rope_scaling`` / ``n_layers`` overrides; None where unset. complete.json records it, so
    that a message can name the settings that build a checkpoint's model (``hf_llama.model_changes``)."""
    model = config.model
    return {"hf_config": hf_folder_path(model.hf_config) if model.hf_config else None,
            "flavor": None if model.hf_config else model.flavor,
            "rope_scaling": None if model.rope_scaling == "default" else model.rope_scaling,
            "n_layers": model.n_layers or None}


def check_initial_weights(config: JobConfig, model_args: ModelArgs) -> None:
    """Hugging Face weights to start from (``[checkpoint] initial_load_path``) must compute with this model what
    their config says and be one whole, readable set of its weights, checked from the folder's config.json and the
    files' headers before anything is built; and tied embeddings cannot be split across pipeline stages."""
    initial = config.checkpoint.initial_load_path
    if initial and Path(initial).is_dir():
        refuse_other_weight_formats(Path(initial))
    if initial and is_hf_folder(initial):
        check_hf_folder(initial, model_args, model_name(config), model_choice(config))
    if model_args.tie_word_embeddings and config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            f"[model] {model_name(config)} ties its output projection to the token embedding, which pipeline "
            "parallel would put on different stages; train it without pipeline parallel (FSDP and tensor parallel "
            "work), as its size (Llama 3.2 1B / 3B) allows."
        )


def check_vocabulary(config: JobConfig, args: ModelArgs, tokenizer_vocab_size: int) -> None:
    """The tokenizer's ids must fit the model's embedding."""
    if tokenizer_vocab_size > args.vocab_size:
        raise ConfigError(
            f"[model] tokenizer_path {config.model.tokenizer_path} has {tokenizer_vocab_size} tokens but "
            f"{model_name(config)} has a vocabulary of {args.vocab_size}; use a matching tokenizer or model."
        )
