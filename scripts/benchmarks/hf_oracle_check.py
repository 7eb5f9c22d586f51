"""Our Llama 3 against Hugging Face ``transformers`` (the ``dev`` extra), both ways, with the numbers in one table.

    python scripts/benchmarks/hf_oracle_check.py

Exports the debug model and its tied, 32x-scaled twin and loads them in ``LlamaForCausalLM``; writes folders with
``transformers`` (Llama 3.1 scaling, Llama 3.2 scaling with tying, theta 1e4 / epsilon 1e-6) and imports them
through ``[model] hf_config``. Prints the logits' error (max |d| / max |logit|, fp32) at 128 and 4,096 tokens, and
for the imports the error and greedy agreement of the model as the import built it before the folder's RoPE and
epsilon were read (Llama 3's theta 5e5, no scaling, epsilon 1e-5). ``tests/test_hf_oracle.py`` asserts 1e-4.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan_simple.models.hf_llama import model_args_from_hf, read_hf_config, save_hf
from titan_simple.models.llama3 import Transformer, build_model
from titan_simple.trainer.checkpoint import load_model_weights

LENGTHS = (128, 4096)
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=2000, max_position_embeddings=131072)
SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
FOLDERS = {
    "Llama 3.1 x8": dict(rope_theta=500000.0, rope_scaling={**SCALING, "factor": 8.0}, rms_norm_eps=1e-5),
    "Llama 3.2 x32, tied": dict(rope_theta=500000.0, rope_scaling={**SCALING, "factor": 32.0}, rms_norm_eps=1e-5,
                                tie_word_embeddings=True),
    "theta 1e4, eps 1e-6": dict(rope_theta=10000.0),
}


@torch.no_grad()
def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def error(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{((a - b).abs().max() / b.abs().max()).item():.1e}"


def agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a.argmax(-1) == b.argmax(-1)).float().mean().item():.0%}"


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 2000, (1, n), generator=generator) for n in LENGTHS]
    print(f"| case | {' | '.join(f'{n} tokens' for n in LENGTHS)} | before (error / greedy agreement) |")
    print("|---|" + "---|" * (len(LENGTHS) + 1))
    for flavor in ("debugmodel", "debugmodel_tied"):
        ours = build_model(flavor, max_seq_len=max(LENGTHS), device="cpu")
        folder = Path(tempfile.mkdtemp())
        save_hf(ours.state_dict(), ours.args, folder)
        theirs = LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
        results = [error(logits(ours, t), logits(theirs, t)) for t in tokens]
        print(f"| export {flavor} | {' | '.join(results)} | |")
    for name, settings in FOLDERS.items():
        torch.manual_seed(0)
        theirs = LlamaForCausalLM(LlamaConfig(**SHAPE, **settings, initializer_range=0.2)).eval()
        folder = Path(tempfile.mkdtemp())
        theirs.save_pretrained(str(folder))
        args = model_args_from_hf(read_hf_config(folder), str(folder), max_seq_len=max(LENGTHS))
        ours = Transformer(args)
        load_model_weights(str(folder), ours)
        before = Transformer(dataclasses.replace(args, rope_scaling=None, rope_theta=500000.0, norm_eps=1e-5))
        before.load_state_dict(ours.state_dict())
        results = [error(logits(ours, t), logits(theirs, t)) for t in tokens]
        old = [f"{error(logits(before, t), logits(theirs, t))} / {agreement(logits(before, t), logits(theirs, t))}"
               for t in tokens]
        print(f"| import {name} | {' | '.join(results)} | {', '.join(old)} |")


if __name__ == "__main__":
    main()
