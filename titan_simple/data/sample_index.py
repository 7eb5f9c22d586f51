"""The global sample index: training sample ``g`` of a token store, the same on every layout.

Per epoch ``e`` the store's documents are put in a seeded random order (``document_order``), concatenated, and
cut into windows of ``seq_len + 1`` tokens; the windows are then visited in a seeded random order too, so that
one global batch mixes windows from all over the corpus rather than consecutive windows of one long document
(as Megatron-LM's document, sample and shuffle indices do). Global sample ``g = e * samples_per_epoch + i`` is
the ``i``-th window of epoch ``e``'s window order. Without a seed both orders are the store's. The tokens left
over at the end of an epoch (fewer than one window) are not used. A long document spans windows; short ones
share a window (as BOS ... EOS BOS ... EOS).

The trainer reads sample ``g = consumed + r`` for row ``r`` of the next global batch (``datasets.GlobalSamples``):
the data order depends on the corpus, the seed and the sequence length only, and a checkpoint needs just the
number of samples consumed to resume exactly, on any layout and with any global batch.

For each epoch three small arrays are made once and kept next to the store (``index/``, memory-mapped):
the document order, for every window where it starts (its first document's position in that order and the
offset into it), and the window order. Reading a window is then a slice or two of the memory-mapped tokens.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from titan_simple.data.token_store import TokenStore
from titan_simple.errors import ConfigError

logger = logging.getLogger(__name__)


def document_order(num_documents: int, seed: int | None, epoch: int) -> np.ndarray:
    """The documents of ``epoch``: store order without a seed, else a permutation seeded by ``(seed, epoch)``."""
    return _permutation(num_documents, seed, 2 * epoch)


def window_order(num_windows: int, seed: int | None, epoch: int) -> np.ndarray:
    """The order ``epoch``'s windows are read in: as cut without a seed, else seeded by ``(seed, epoch)``."""
    return _permutation(num_windows, seed, 2 * epoch + 1)


def _permutation(n: int, seed: int | None, stream: int) -> np.ndarray:
    if seed is None:
        return np.arange(n, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    return torch.randperm(n, generator=generator).numpy()


def window_starts(lengths_in_order: np.ndarray, window: int) -> np.ndarray:
    """``[windows + 1, 2]``: (position in the order, offset in that document) of each window's first token,
    and of the first token after the last window."""
    ends = np.cumsum(lengths_in_order)
    windows = int(ends[-1]) // window if len(ends) else 0
    starts = np.arange(windows + 1, dtype=np.int64) * window
    position = np.searchsorted(ends, starts, side="right")  # the first document that ends after the start
    document_start = np.concatenate([[0], ends])[position]
    return np.stack([position, starts - document_start], axis=1)


class SampleIndex:
    """Samples of ``seq_len + 1`` tokens from ``store``: ``sample(g)`` is a ``[seq_len + 1]`` int64 tensor."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int | None, where: str) -> None:
        self.store = store
        self.window = seq_len + 1
        self.seed = seed
        self.samples_per_epoch = store.num_tokens // self.window
        if self.samples_per_epoch == 0:
            raise ConfigError(
                f"{where} has {store.num_tokens:,} tokens, fewer than one sequence of seq_len + 1 = {self.window:,}; "
                "add data or lower seq_len"
            )
        self._lengths = store.document_lengths()
        self._epoch = -1
        self._order = self._starts = self._windows = np.zeros(0, dtype=np.int64)

    def _window(self, index: int) -> int:
        """Which window of its epoch's cut sample ``index`` is."""
        epoch, position = divmod(index, self.samples_per_epoch)
        if epoch != self._epoch:
            self._load_epoch(epoch)
        return int(self._windows[position])

    def sample(self, index: int) -> torch.Tensor:
        window = self._window(index)
        (position, offset), (end_position, end_offset) = self._starts[window], self._starts[window + 1]
        offsets, pieces = self.store.offsets, []
        # The last window of an epoch ends at (len(order), 0): one past the last document.
        for k in range(int(position), min(int(end_position), len(self._order) - 1) + 1):
            document = int(self._order[k])
            start = int(offsets[document]) + (int(offset) if k == position else 0)
            stop = int(offsets[document]) + int(end_offset) if k == end_position else int(offsets[document + 1])
            if stop > start:
                pieces.append(self.store.tokens_between(start, stop))
        tokens = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        return torch.from_numpy(tokens.astype(np.int64))

    def documents_of(self, index: int) -> list[int]:
        """The store's documents that sample ``index`` reads from (for tests and debugging)."""
        window = self._window(index)
        (position, _), (end_position, end_offset) = self._starts[window], self._starts[window + 1]
        last = int(end_position) if end_offset > 0 else int(end_position) - 1
        return [int(self._order[k]) for k in range(int(position), last + 1)]

    def _load_epoch(self, epoch: int) -> None:
        """This epoch's orders and window starts: from ``index/`` if made before, else made and saved there."""
        name = f"seq{self.window - 1}-seed{'none' if self.seed is None else self.seed}-epoch{epoch}"
        paths = [self.store.folder / "index" / f"{name}.{part}.npy" for part in ("order", "starts", "windows")]
        if all(path.is_file() for path in paths):
            self._order, self._starts, self._windows = (np.load(path, mmap_mode="r") for path in paths)
        else:
            self._order = document_order(self.store.num_documents, self.seed, epoch)
            self._starts = window_starts(self._lengths[self._order], self.window)
            self._windows = window_order(self.samples_per_epoch, self.seed, epoch)
            for path, array in zip(paths, (self._order, self._starts, self._windows), strict=True):
                _save_quietly(path, array)
        self._epoch = epoch


def _save_quietly(path: Path, array: np.ndarray) -> None:
    """Atomically (ranks that race write the same bytes); a read-only store keeps the index in memory."""
    try:
        path.parent.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            np.save(f, array)
        os.replace(f.name, path)
    except OSError as error:
        logger.debug("data: the sample index stays in memory (%s is not writable: %s)", path.parent, error)
