"""Train the small byte-level BPE tokenizer shipped as ``assets/tokenizer/shakespeare_bpe_2k.json``.

    python scripts/train_tokenizer.py                     # 2000 tokens, written to the assets folder
    python scripts/train_tokenizer.py --vocab_size 4096 --output /tmp/bpe_4k.json

Trained on the train split of the built-in Shakespeare corpus with Llama 3's pre-tokenization (its split
regex, then bytes), so it behaves like a miniature Llama 3 tokenizer: ids 0 and 1 are ``<|begin_of_text|>``
and ``<|end_of_text|>``, then the 256 byte tokens, then the learned merges. Same inputs, same file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PROJECT_DIR = Path(__file__).resolve().parent.parent

from titan_simple.data.datasets import shakespeare_files  # noqa: E402
from titan_simple.data.tokenizer import BEGIN_OF_TEXT, END_OF_TEXT, byte_level_pre_tokenizer  # noqa: E402

DEFAULT_OUTPUT = PROJECT_DIR / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BEGIN_OF_TEXT, END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    texts = [path.read_text(encoding="utf-8") for path in shakespeare_files("train")]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vocab_size", type=int, default=2000, help="Tokens in the vocabulary, specials included."
    )
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="Where to write the tokenizer.json."
    )
    args = parser.parse_args()
    if args.vocab_size < 258:
        parser.error("--vocab_size must be at least 258 (2 special tokens + 256 bytes)")

    tokenizer = train_tokenizer(args.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.output), pretty=True)
    print(f"wrote {args.output} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
