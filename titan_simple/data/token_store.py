"""The token store: a corpus tokenized once, on disk, memory-mapped by every run that reads it.

Layout of one store (a folder under ``[training] data_cache``)::

    tokens.bin     every document's ids (BOS text EOS), concatenated, uint32, in source order
    offsets.npy    int64 [documents + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    meta.json      what it was built from (the key) and its sizes; written last
    index/         the sample index's per-epoch arrays (sample_index.py), made on first use

The folder's name is a hash of the key: the source files (absolute paths, sizes, modification times), the reader,
the tokenizer file's content hash and the BOS/EOS framing. Changing any of them names another folder, so a run
never reads a store built from other files or with another tokenizer; it builds the new one (and says why once).

Building: the documents are read and tokenized with Hugging Face ``datasets`` (``load_dataset`` into a scratch
Arrow cache, then a batched ``map`` with ``num_proc`` processes and the fast tokenizer), and the ids are
written out flat. Everything is written into ``<name>.partial-<host>-<pid>`` and renamed to ``<name>`` when
complete: a build stopped by Ctrl-C or SIGKILL leaves at most a partial folder, which is never opened (the
next run removes it if its process is gone, and builds again).

Opening is two ``numpy`` memory maps: no corpus in RAM, milliseconds whatever its size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from titan_simple.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint32  # Llama 3's 128K vocabulary needs more than 16 bits
META_FILE = "meta.json"
# Below this much source text one process tokenizes faster than a pool of them starts.
PARALLEL_BUILD_MIN_BYTES = 64 << 20
WAIT_POLL_SECONDS = 0.2
# A failure file older than this process is an earlier run's. (Rank 0 can only fail after the process group's
# rendezvous, which every rank reaches after importing this module.)
_IMPORTED_AT = time.time()


@dataclass(frozen=True)
class StoreSource:
    """What a store is built from: ``reader`` (text/json/parquet) over ``files``, with one tokenizer."""

    reader: str
    files: tuple[Path, ...]
    tokenizer_path: Path
    where: str  # how the config names it, for messages ("the shakespeare dataset", "[training] dataset_path x")

    def key(self) -> dict[str, Any]:
        """Everything whose change makes another store (see the module docstring)."""
        files = []
        for path in self.files:
            stat = path.stat()
            files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        return {"format": FORMAT_VERSION, "reader": self.reader, "files": files,
                "tokenizer_sha256": file_sha256(self.tokenizer_path), "framing": "bos+text+eos"}

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def store_name(key: dict[str, Any]) -> str:
    return "tokens-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _files_name(key: dict[str, Any]) -> str:
    """The same for every store of these file paths (whatever their content or tokenizer)."""
    paths = [entry[0] for entry in key["files"]]
    return hashlib.sha256(json.dumps([key["reader"], paths]).encode()).hexdigest()[:20]


class TokenStore:
    """A built store, opened read-only: ``tokens`` (memory-mapped) and ``offsets`` (document i is
    ``tokens[offsets[i]:offsets[i + 1]]``); ``tokens_between`` is what training reads."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        try:
            self.meta = json.loads((folder / META_FILE).read_text())
            self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
            expected = int(self.offsets[-1]) * np.dtype(TOKEN_DTYPE).itemsize
            actual = (folder / "tokens.bin").stat().st_size
            if actual != expected:
                raise ValueError(f"tokens.bin holds {actual} bytes, the offsets say {expected}")
            self.tokens = (np.memmap(folder / "tokens.bin", dtype=TOKEN_DTYPE, mode="r") if expected
                           else np.zeros(0, dtype=TOKEN_DTYPE))
            self._file = (folder / "tokens.bin").open("rb", buffering=0)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            raise DataError(f"token store {folder} is damaged ({error}); delete that folder and the next run "
                            "builds it again") from None

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def tokens_between(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)``, read with ``pread``: a training run reads a few KB at random places per
        step, and reading them through the memory map would fault in the kernel's read-ahead around each one,
        which counts in the process's RSS (~90 MiB after 20 steps on a 1 GiB corpus); the page cache does not."""
        itemsize = np.dtype(TOKEN_DTYPE).itemsize
        data = os.pread(self._file.fileno(), (stop - start) * itemsize, start * itemsize)
        return np.frombuffer(data, dtype=TOKEN_DTYPE)


# ------------------------------------------------------------------------------------------- opening


def open_or_build(source: StoreSource, tokenizer: Any, cache: Path, *, builds: bool,
                  num_proc: int | None = None) -> TokenStore:
    """The store of ``source``: opened if built, else built by the caller with ``builds`` (rank 0) while the
    others wait for it to appear. ``cache`` must be a folder every rank sees."""
    key = source.key()
    folder = cache / store_name(key)
    if (folder / META_FILE).is_file():
        store = TokenStore(folder)
        logger.info("data: %s: %s documents, %s tokens, from the token store %s", source.where,
                    f"{store.num_documents:,}", f"{store.num_tokens:,}", folder)
        return store
    if builds:
        build(source, tokenizer, key, folder, num_proc=num_proc)
    else:
        _wait_for(folder, source)
    return TokenStore(folder)


def _wait_for(folder: Path, source: StoreSource) -> None:
    """Wait while rank 0 builds; its failure (written next to the store) fails here too, in the same words."""
    failed = folder.with_name(folder.name + ".failed")
    logger.info("data: waiting for rank 0 to tokenize %s into %s", source.where, folder)
    while not (folder / META_FILE).is_file():
        if failed.is_file() and failed.stat().st_mtime >= _IMPORTED_AT - 1.0:
            kind, _, message = failed.read_text().strip().partition("\t")
            raise (ConfigError if kind == "ConfigError" else DataError)(message)
        time.sleep(WAIT_POLL_SECONDS)


def check_writable(cache: Path) -> None:
    """One clear line if the store cannot be written (before any tokenizing)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ConfigError(f"[training] data_cache {cache} is not writable ({error.strerror or error}); set "
                          "--training.data_cache to a writable folder that every rank can read") from None


# ------------------------------------------------------------------------------------------- building


def build(source: StoreSource, tokenizer: Any, key: dict[str, Any], folder: Path,
          num_proc: int | None = None) -> None:
    """Tokenize ``source`` into ``folder`` (atomically: see the module docstring)."""
    cache = folder.parent
    check_writable(cache)
    _remove_dead_partials(cache, folder.name)
    _say_why_rebuilt(cache, key)
    failed = folder.with_name(folder.name + ".failed")
    failed.unlink(missing_ok=True)
    partial = cache / f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    num_proc = num_proc or default_build_processes(source.total_bytes())
    started = time.perf_counter()
    try:
        documents, tokens = _tokenize_into(partial, source, tokenizer, num_proc, fingerprint=folder.name)
        (partial / META_FILE).write_text(json.dumps(
            {"key": key, "documents": documents, "tokens": tokens, "built_by": f"{socket.gethostname()}:"
             f"{os.getpid()}", "build_seconds": round(time.perf_counter() - started, 2)}, indent=1))
        try:
            partial.rename(folder)
        except OSError:  # another job finished the same store first: theirs is identical
            if not (folder / META_FILE).is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException as error:  # Ctrl-C included: never leave a half-built store, and tell the waiters
        shutil.rmtree(partial, ignore_errors=True)
        message = str(error) if isinstance(error, (ConfigError, DataError)) else (
            f"rank 0 failed to build the token store {folder} ({type(error).__name__}: {error})")
        try:
            failed.write_text(f"{type(error).__name__}\t{message}\n")
        except OSError:
            pass
        raise
    seconds = time.perf_counter() - started
    logger.info("data: tokenized %s: %d file(s), %s documents, %s tokens in %.1f s (%s tokens/s, %d process(es)) "
                "into %s", source.where, len(source.files), f"{documents:,}", f"{tokens:,}", seconds,
                f"{tokens / max(seconds, 1e-9):,.0f}", num_proc, folder)


def default_build_processes(total_bytes: int) -> int:
    if total_bytes < PARALLEL_BUILD_MIN_BYTES:
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _tokenize_into(partial: Path, source: StoreSource, tokenizer: Any, num_proc: int,
                   fingerprint: str) -> tuple[int, int]:
    """Read and tokenize with ``datasets``; write ``tokens.bin`` and ``offsets.npy``. Returns (documents, tokens)."""
    from titan_simple.data.documents import load_documents_to_disk  # noqa: PLC0415

    scratch = partial / "scratch"
    with datasets_progress_bars(enabled=False):
        documents = load_documents_to_disk(source.reader, list(source.files), source.where, scratch, num_proc)
    if len(documents) == 0:
        raise ConfigError(f"{source.where} holds no documents; point it at your data")
    encode = _BatchEncoder(tokenizer)
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    # One tokenizer thread per worker process; with one process the Rust tokenizer may use every core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if num_proc > 1 else "true"
    try:
        with datasets_progress_bars(enabled=True):
            ids = documents.map(encode, batched=True, batch_size=256, num_proc=num_proc if num_proc > 1 else None,
                                remove_columns=documents.column_names, desc=f"tokenizing {source.where}",
                                new_fingerprint=f"tokenize-{fingerprint}",
                                cache_file_name=str(scratch / "ids.arrow"))
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    lengths = np.zeros(len(ids) + 1, dtype=np.int64)
    written = 0
    with (partial / "tokens.bin").open("wb") as out:
        column = ids.data.column("ids")
        for chunk in column.chunks:
            flat = chunk.flatten().to_numpy(zero_copy_only=False).astype(TOKEN_DTYPE, copy=False)
            out.write(flat.tobytes())
            chunk_lengths = np.diff(chunk.offsets.to_numpy())
            lengths[1 + written: 1 + written + len(chunk_lengths)] = chunk_lengths
            written += len(chunk_lengths)
    np.save(partial / "offsets.npy", np.cumsum(lengths))
    del ids, documents
    shutil.rmtree(scratch, ignore_errors=True)
    return len(lengths) - 1, int(lengths.sum())


class _BatchEncoder:
    """``{"text": [...]} -> {"ids": [[BOS ... EOS], ...]}`` (picklable, for ``map``'s worker processes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": self.tokenizer.encode_batch(batch["text"], bos=True, eos=True)}


@contextlib.contextmanager
def datasets_progress_bars(enabled: bool) -> Iterator[None]:
    """``datasets``' progress bars on or off inside the block (a build shows only its tokenizing bar)."""
    import datasets  # noqa: PLC0415

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    (datasets.utils.enable_progress_bars if enabled else datasets.utils.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.utils.enable_progress_bars if was_enabled else datasets.utils.disable_progress_bars)()


def _remove_dead_partials(cache: Path, name: str) -> None:
    """Partial folders of this store left by a process of this host that no longer runs (Ctrl-C, SIGKILL)."""
    host = socket.gethostname()
    for partial in cache.glob(f"{name}.partial-*"):
        owner_host, _, pid = partial.name.rsplit(".partial-", 1)[1].rpartition("-")
        if owner_host == host and pid.isdigit() and not _process_alive(int(pid)):
            logger.info("data: removing %s, left by an interrupted build", partial)
            shutil.rmtree(partial, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover from an earlier attempt in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _say_why_rebuilt(cache: Path, key: dict[str, Any]) -> None:
    """One line when a store of the same file paths exists but no longer matches (files or tokenizer changed)."""
    family = _files_name(key)
    olds = []
    for meta_path in sorted(cache.glob(f"tokens-*/{META_FILE}")):
        try:
            old = json.loads(meta_path.read_text())["key"]
        except (OSError, ValueError, KeyError):
            continue
        if _files_name(old) == family and old != key:
            olds.append((old, meta_path.parent))
    if not olds:
        return
    same_files = [(old, folder) for old, folder in olds if old["files"] == key["files"]]
    if not same_files:
        reason, folder = "the data files changed since", olds[-1][1]
    elif any(old["tokenizer_sha256"] != key["tokenizer_sha256"] for old, _ in same_files):
        reason, folder = "the tokenizer is not the one", same_files[-1][1]
    else:
        reason, folder = "the store format changed since", same_files[-1][1]
    logger.warning("data: %s %s was built: tokenizing again (the old store can be deleted)", reason, folder)
