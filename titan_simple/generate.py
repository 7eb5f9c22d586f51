"""Sample text from a trained model on one process: load a checkpoint, then generate with a KV cache.

    model = load_model_for_generation(config, "outputs/llama3_debug/checkpoint")  # or .../step-100
    result = generate(model, tokenizer.encode("ROMEO:", eos=False), max_new_tokens=50, temperature=0.8, top_k=40)
    print(tokenizer.decode(result.tokens))

``scripts/generate.py`` is the command-line front end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.models.attention import AttentionInputs, KVCache
from titan_simple.models.from_config import model_args_for, model_choice, model_name
from titan_simple.models.llama3 import Transformer
from titan_simple.trainer.checkpoint import check_checkpoint, read_model_weights, single_process_is_fine

# ------------------------------------------------------------------------------------------ loading


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU; fp32 on CPU, where bf16 matmuls are slower (the same choice as training's ``auto``)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model_for_generation(
    config: JobConfig,
    checkpoint: str | None,
    *,
    max_seq_len: int | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Transformer:
    """The config's model (its flavor or ``[model] hf_config``) with the checkpoint's weights, in eval mode; random
    init when ``checkpoint`` is None.

    ``checkpoint``: a DCP ``step-N`` folder, a checkpoint folder (its newest complete step) or a Hugging Face
    Llama folder (config.json + safetensors), as ``trainer.checkpoint.load_model_weights`` reads them. It is
    checked before anything is built, as the trainer's ``initial_load_path`` is (``check_checkpoint``): a Hugging
    Face folder whose config.json computes another function than the config's model, or whose files are not one
    whole set, and a step folder of another shape or tying are refused (ConfigError); a step folder saved with
    other RoPE or norm epsilon (its complete.json) is loaded with a warning. ``max_seq_len`` sizes the RoPE table
    (default: ``[training] seq_len``); positions past the trained length run but are outside what the model has
    learnt.
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or default_dtype(device)
    args = model_args_for(config, max_seq_len)
    path = None
    if checkpoint is not None:
        with single_process_is_fine():  # DCP warns that it reads on one process: that is the intent here
            path = check_checkpoint(checkpoint, args, choice=model_choice(config), model_name=model_name(config))
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # also fills the RoPE table, which checkpoints do not hold
    for param in model.parameters():  # not model.to(dtype): that would drop the RoPE table's imaginary part
        param.data = param.data.to(dtype)
    if path is not None:
        read_model_weights(path, model)
    return model.eval()


# ---------------------------------------------------------------------------------------- sampling


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> int:
    """One token from ``logits`` ``[vocab]``: argmax at temperature 0, else softmax(logits / T) over the top k."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, without the prompt
    logits: list[torch.Tensor] = field(repr=False)  # the next-token logits each token was drawn from (fp32)
    prefill_seconds: float
    decode_seconds: float  # every token after the first

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: tokens after the first over the time they took (the prompt pass excluded)."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else float("nan")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _check_generation(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float,
                      top_k: int | None) -> None:
    """One line for each setting generation cannot run with."""
    if not prompt:
        raise ConfigError("the prompt is empty; give at least one token (the tokenizer adds BOS)")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens = {max_new_tokens}; expected at least 1")
    if temperature < 0:
        raise ConfigError(f"temperature = {temperature}; expected 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k = {top_k}; expected at least 1")
    if len(prompt) + max_new_tokens - 1 > model.freqs_cis.shape[0]:
        raise ConfigError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len {model.freqs_cis.shape[0]}; shorten them"
        )


def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_token: int | None = None,
    use_kv_cache: bool = True,
) -> Generation:
    """Extend ``prompt`` by up to ``max_new_tokens`` tokens (fewer if ``stop_token`` is drawn).

    With the KV cache the prompt is run once and then one token per step; without it every step reruns the
    whole sequence (quadratic, kept as the reference the cache is tested against). The same ``seed`` gives
    the same tokens.
    """
    _check_generation(model, prompt, max_new_tokens, temperature, top_k)
    device = model.freqs_cis.device
    max_len = len(prompt) + max_new_tokens - 1  # the last token drawn is never fed back
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    dtype = next(model.parameters()).dtype
    inputs = AttentionInputs(cache=KVCache(model.args, 1, max_len, device, dtype)) if use_kv_cache else None

    sequence = torch.tensor([prompt], device=device)
    new_tokens: list[int] = []
    all_logits: list[torch.Tensor] = []
    start = time.perf_counter()
    prefill_seconds = 0.0
    feed = sequence  # what this step runs through the model
    while True:
        logits = model(feed, inputs)[0, -1].float()
        token = sample_next_token(logits, temperature, top_k, generator)
        new_tokens.append(token)
        all_logits.append(logits)
        if len(new_tokens) == 1:  # the prompt pass is timed apart from the per-token steps
            _synchronize(device)
            prefill_seconds = time.perf_counter() - start
        if len(new_tokens) == max_new_tokens or token == stop_token:
            break
        next_token = torch.tensor([[token]], device=device)
        sequence = torch.cat([sequence, next_token], dim=1)
        feed = next_token if use_kv_cache else sequence
    _synchronize(device)
    decode_seconds = time.perf_counter() - start - prefill_seconds
    return Generation(new_tokens, all_logits, prefill_seconds, decode_seconds)
