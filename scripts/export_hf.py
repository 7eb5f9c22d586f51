"""Export a checkpoint's model as Hugging Face Llama weights (safetensors + config.json), in one process.

    .venv/bin/python scripts/export_hf.py --checkpoint outputs/llama3_debug/checkpoint/step-100 \\
        --output outputs/llama3_debug/hf --dtype bfloat16

``--checkpoint`` is a ``step-N`` folder or a checkpoint folder (its newest complete step). The model shape
comes from the checkpoint's ``complete.json``; ``--flavor`` (and ``--max_seq_len``) override it, for a
DCP folder written elsewhere. Any layout can be exported: DCP gathers the shards. The result loads with
``transformers.LlamaForCausalLM.from_pretrained(output)`` and back into titan_simple with
``[checkpoint] initial_load_path = "<output>"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

from titan_simple.errors import ConfigError, UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from titan_simple.models.llama3 import LLAMA3_FLAVORS
    from titan_simple.trainer.checkpoint import EXPORT_DTYPES, complete_steps, export_hf, find_checkpoint, model_args_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step-N folder, or a checkpoint folder (newest step)")
    parser.add_argument("--output", required=True, help="folder to write config.json and *.safetensors into")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="weight dtype (default float32)")
    parser.add_argument("--flavor", choices=list(LLAMA3_FLAVORS), help="model flavor, if complete.json lacks it")
    parser.add_argument("--max_seq_len", type=int, help="max_position_embeddings to record (default: as trained)")
    args = parser.parse_args(argv)
    try:
        checkpoint = Path(args.checkpoint)
        if not checkpoint.is_dir():
            raise ConfigError(f"checkpoint {checkpoint} does not exist.")
        if not (checkpoint / ".metadata").is_file() and complete_steps(checkpoint):
            checkpoint = find_checkpoint(checkpoint)
        model_args = LLAMA3_FLAVORS[args.flavor] if args.flavor else model_args_of(checkpoint)
        if model_args is None:
            raise ConfigError(f"checkpoint {checkpoint} records no model shape (no complete.json); pass --flavor.")
        if args.max_seq_len:
            model_args = dataclasses.replace(model_args, max_seq_len=args.max_seq_len)
        output = export_hf(checkpoint, args.output, dtype=EXPORT_DTYPES[args.dtype], args=model_args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {output} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
