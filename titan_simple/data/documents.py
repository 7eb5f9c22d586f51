"""Reading documents: a list of data files -> one ``text`` column (Hugging Face ``datasets``).

The one reader of data files. ``load_documents_to_disk`` is what a token store build reads (token_store.py):
each file read once, into a scratch Arrow cache that the tokenizing ``map`` then splits among processes.
Local ``.txt`` files are read whole: one file is one document (BOS ... EOS), not one line; for one document per
line use ``.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from titan_simple.errors import ConfigError, UserError


def _require_text_column(documents: datasets.Dataset, where: str) -> datasets.Dataset:
    columns = documents.column_names or []
    if "text" not in columns:
        raise ConfigError(
            f"{where} has no 'text' column (found: {', '.join(columns) or 'none'}); "
            "store each document's text in a column named 'text'"
        )
    return documents.select_columns(["text"])


# Our readers -> Hugging Face's builder and its options: a text file is one document; "paragraphs" reads each
# blank-line-separated paragraph of a text file as a document of its own.
READERS: dict[str, tuple[str, dict[str, Any]]] = {
    "text": ("text", {"sample_by": "document"}), "paragraphs": ("text", {"sample_by": "paragraph"}),
    "json": ("json", {}), "parquet": ("parquet", {}),
}


def _builder(reader: str) -> tuple[str, dict[str, Any]]:
    return READERS.get(reader, (reader, {}))


def load_documents_to_disk(builder: str, files: list[Path], where: str, scratch: Path,
                           num_proc: int) -> datasets.Dataset:
    """The documents of ``files`` in that order as a ``text`` column, in an Arrow cache under ``scratch``."""
    builder, options = _builder(builder)
    try:
        documents = datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", cache_dir=str(scratch),
            num_proc=num_proc if num_proc > 1 and len(files) > 1 else None, **options)
        return _require_text_column(documents, where)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 -- pyarrow / json / decoding errors of the user's files
        raise ConfigError(unreadable_message(builder, files, error, where)) from None


def _stream(builder: str, files: list[Path]) -> datasets.IterableDataset:
    builder, options = _builder(builder)
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **options)


def unreadable_message(builder: str, files: list[Path], error: Exception, where: str) -> str:
    """One line naming the first of ``files`` that fails to parse (each is read alone to find it; only on this
    error path), with the reader's message; or saying that they hold no documents at all."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    rows = 0
    for path in files:
        try:
            rows += sum(1 for _ in _stream(builder, [path]))
        except Exception as file_error:  # noqa: BLE001
            detail = str(file_error).strip().splitlines()[0] if str(file_error).strip() else reason
            return f"data file {path} cannot be read as {builder} ({detail}); fix or remove it"
    if rows == 0:
        return f"{where} holds no documents; point it at your data"
    return f"data: a {builder} file cannot be read ({reason}); fix or remove it"
