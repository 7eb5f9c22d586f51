"""Tokenize a corpus into its token store ahead of training (one process; the store is then opened in ms).

    .venv/bin/python scripts/prepare_data.py --config configs/llama3_8b.toml --num_proc 16 \\
        [--training.dataset_path /data/corpus --training.data_cache /shared/token_store ...]

Takes the same config and overrides as ``train.py``, so the store it builds is the one training looks up (same
files, tokenizer and ``[training] data_cache``): the training data (each source of a ``[[training.mixture]]``) and,
with ``[validation] enable``, the held-out data (each source of a ``[[validation.mixture]]``). A store that is
already built is reported, not rebuilt.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from titan_simple.config import load_job_config, resolve_project_path  # noqa: E402
from titan_simple.data.datasets import data_cache_folder, open_store  # noqa: E402
from titan_simple.data.tokenizer import Tokenizer  # noqa: E402
from titan_simple.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_proc", type=int, default=None,
                        help="tokenizing processes (default: 1 below 64 MiB of text, else up to 8 cores)")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        config = load_job_config(rest)
        tokenizer = Tokenizer(resolve_project_path(config.model.tokenizer_path))
        cache = data_cache_folder(config.training.data_cache)
        for split, label, dataset, dataset_path in _wanted(config):
            started = time.perf_counter()
            store, where = open_store(dataset=dataset, dataset_path=dataset_path, split=split, tokenizer=tokenizer,
                                      cache=cache, num_proc=args.num_proc)
            print(f"{label}: {where}: {store.num_documents:,} documents, {store.num_tokens:,} tokens in "
                  f"{store.folder} ({time.perf_counter() - started:.1f} s)")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _wanted(config) -> list[tuple[str, str, str, str | None]]:
    """(split, label, dataset, dataset_path) of every store the run reads: each source of a mixture, else the
    single dataset; the held-out ones with [validation] enable."""
    wanted = []
    for split, section in (("train", config.training), ("validation", config.validation)):
        if split == "validation" and not config.validation.enable:
            continue
        if section.mixture:
            wanted += [(split, f"{split} '{entry.name}'", entry.dataset, entry.dataset_path)
                       for entry in section.mixture]
        else:
            wanted.append((split, split, section.dataset, section.dataset_path))
    return wanted


if __name__ == "__main__":
    raise SystemExit(main())
