"""Generate text from a checkpoint on one process (KV cache; temperature and top-k sampling).

    .venv/bin/python scripts/generate.py --config configs/llama3_debug.toml \\
        --checkpoint outputs/llama3_debug/checkpoint --prompt "ROMEO:" --max_new_tokens 100 --top_k 40

``--checkpoint`` is a DCP step folder (``<dump_folder>/checkpoint/step-N``), a folder of step folders (the
newest complete one is used) or an exported Hugging Face folder (config.json + *.safetensors). Any
``--section.key value`` override of train.py is accepted too (e.g. ``--model.flavor``). The text goes to
stdout, the speed to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

from titan_simple.errors import UserError  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Other --section.key value arguments override the config, as in train.py.",
    )
    parser.add_argument("--config", required=True, help="TOML job config (the one the model was trained with)")
    parser.add_argument(
        "--checkpoint", required=True, help="DCP step-N folder, a folder of them (newest), or a Hugging Face folder"
    )
    parser.add_argument("--prompt", required=True, help="text to continue (BOS is prepended)")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same text (default 0)")
    parser.add_argument("--no_kv_cache", action="store_true", help="rerun the whole sequence every step (slow)")
    args, overrides = parser.parse_known_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top_k must be at least 1, got {args.top_k}")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        from titan_simple.config import load_job_config, resolve_project_path
        from titan_simple.data.tokenizer import Tokenizer
        from titan_simple.generate import generate, load_model_for_generation

        config = load_job_config(["--config", args.config, *overrides])
        tokenizer = Tokenizer(resolve_project_path(config.model.tokenizer_path))
        prompt = tokenizer.encode(args.prompt, bos=True, eos=False)
        max_seq_len = max(config.training.seq_len, len(prompt) + args.max_new_tokens)
        model = load_model_for_generation(config, args.checkpoint, max_seq_len=max_seq_len)
        result = generate(
            model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
            stop_token=tokenizer.eos_id, use_kv_cache=not args.no_kv_cache,
        )
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(args.prompt + tokenizer.decode(result.tokens))
    print(
        f"{len(result.tokens)} tokens | prompt {len(prompt)} tokens in {result.prefill_seconds:.3f} s | "
        f"decode {result.tokens_per_second:.1f} tokens/s | {model.args.n_layers} layers, "
        f"{next(model.parameters()).dtype}, {next(model.parameters()).device}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
