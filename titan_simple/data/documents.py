"""Reading documents: a list of data files -> one streamed ``text`` column (Hugging Face ``IterableDataset``).

The one reader of both loaders: ``datasets.py`` (validation, and the file checks) and ``global_order.py`` (the
training streams) open their files here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from titan_simple.errors import ConfigError, UserError


def _require_text_column(documents: datasets.IterableDataset, where: str) -> datasets.IterableDataset:
    columns = documents.column_names
    if columns is None:  # json: the schema is only known once a row is read
        first_row = next(iter(documents), None)
        columns = list(first_row) if first_row is not None else []
    if "text" not in columns:
        raise ConfigError(
            f"{where} has no 'text' column (found: {', '.join(columns) or 'none'}); "
            "store each document's text in a column named 'text'"
        )
    return documents.select_columns(["text"])


def open_documents(builder: str, files: list[Path], where: str) -> datasets.IterableDataset:
    """The documents of ``files`` in that order, streamed, as one ``text`` column. Local ``.txt`` files are read
    whole: one file is one document (BOS ... EOS), not one line; for one document per line use ``.jsonl``."""
    documents = _stream(builder, files)
    try:
        return _require_text_column(documents, where)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 -- the first file does not parse
        raise ConfigError(unreadable_message(builder, files[:1], error)) from None


def _stream(builder: str, files: list[Path]) -> datasets.IterableDataset:
    options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **options)


def unreadable_message(builder: str, files: list[Path], error: Exception) -> str:
    """One line naming the first of ``files`` that fails to parse (each is read alone to find it; only on this
    error path), with the reader's message."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for path in files:
        try:
            for _ in _stream(builder, [path]):
                pass
        except Exception as file_error:  # noqa: BLE001
            detail = str(file_error).strip().splitlines()[0] if str(file_error).strip() else reason
            return f"data file {path} cannot be read as {builder} ({detail}); fix or remove it"
    return f"data: a {builder} file cannot be read ({reason}); fix or remove it"
