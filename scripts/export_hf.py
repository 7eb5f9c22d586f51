"""Export a checkpoint's model as Hugging Face Llama weights (safetensors + config.json), in one process.

    .venv/bin/python scripts/export_hf.py --checkpoint outputs/llama3_debug/checkpoint/step-100 \\
        --output outputs/llama3_debug/hf --dtype bfloat16

``--checkpoint`` is a ``step-N`` folder or a checkpoint folder (its newest complete step). The model shape
comes from the checkpoint's ``complete.json``; ``--flavor`` overrides it, for a DCP folder written elsewhere.
``--max_seq_len`` is the ``max_position_embeddings`` written (default: the imported folder's, else the trained
length, at least 131072 with scaled RoPE as Meta writes it). Any layout can be exported: DCP gathers the shards.
A weight set already in ``--output`` is replaced whole (its other files stay); a DCP checkpoint there is refused.
The result loads with ``transformers.LlamaForCausalLM.from_pretrained(output)`` and back into titan_simple with
``[checkpoint] initial_load_path = "<output>"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

PROJECT_DIR = Path(__file__).resolve().parent.parent

from titan_simple.errors import ConfigError, UserError  # noqa: E402

if TYPE_CHECKING:
    from titan_simple.models.llama3 import ModelArgs


def main(argv: list[str] | None = None) -> int:
    from titan_simple.models.llama3 import LLAMA3_FLAVORS
    from titan_simple.trainer.checkpoint import EXPORT_DTYPES, complete_steps, export_hf, find_checkpoint, model_args_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step-N folder, or a checkpoint folder (newest step)")
    parser.add_argument("--output", required=True, help="folder to write config.json and *.safetensors into")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="weight dtype (default float32)")
    parser.add_argument("--flavor", choices=list(LLAMA3_FLAVORS), help="model flavor, if complete.json lacks it")
    parser.add_argument("--max_seq_len", type=int,
                        help="max_position_embeddings to write (default: the imported folder's, else as trained)")
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
        if args.max_seq_len is not None:
            model_args = _with_context(model_args, args.max_seq_len)
        output = export_hf(checkpoint, args.output, dtype=EXPORT_DTYPES[args.dtype], args=model_args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {output} ({args.dtype})")
    return 0


def _with_context(model_args: ModelArgs, context: int) -> ModelArgs:
    """``--max_seq_len``: the context to write, or the ConfigError line when transformers would not take it."""
    scaling = model_args.rope_scaling
    if context < 1:
        raise ConfigError(f"--max_seq_len {context}: expected a positive number of positions.")
    if scaling is not None and context <= scaling.original_context:
        raise ConfigError(f"--max_seq_len {context}: the model's RoPE is scaled from an original context of "
                          f"{scaling.original_context}, and transformers needs max_position_embeddings above it; "
                          f"pass more than {scaling.original_context}, or leave --max_seq_len out.")
    return dataclasses.replace(model_args, max_seq_len=context, max_position_embeddings=context)


if __name__ == "__main__":
    sys.exit(main())
