"""The training data order: defined by the global batch, the same whatever the layout reads it.

A global batch has ``rows`` sequences (``[training] global_batch_size``, or local batch x dp). Row ``r`` of every
global batch comes from its own document stream: the documents at positions ``r, r + rows, r + 2 rows, ...`` of
the epoch's document order, packed into windows of ``seq_len + 1`` tokens (``PackedTokenDataset``). Window ``s``
of stream ``r`` is row ``r`` of global batch ``s``. So the sequences of a step depend only on the data, the seed
and ``rows``, never on how ``dp_replicate x dp_shard``, the local batch and the accumulation steps cut them up:

    data-parallel rank d owns rows [d rows/dp, (d+1) rows/dp)      (its streams; nobody else reads them)
    its k-th local batch of a step = its rows [k lbs, (k+1) lbs)   (accumulation step k)

Each rank reads and tokenizes only its streams' documents (~1/dp of the data). Tensor- and pipeline-parallel
ranks of one dp rank read the same rows.

**Shuffle.** With a seed, every epoch visits the files in a seeded random order (``file_order``); each stream
restarts its own epochs. For the built-in corpus a file is one document, so this is a document shuffle; a local
file with many documents (``.jsonl``, ``.parquet``) keeps their order inside the file.

**Resume.** The state is per stream (its epoch, its position in its documents, its tokens read but not yet
emitted), saved under the stream's index: a run resumed on another data-parallel size loads the streams its
ranks now own and continues exactly where the global order was (the global batch must be the same).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from titan_simple.data.documents import open_documents  # one reader for both loaders
from titan_simple.errors import ConfigError

logger = logging.getLogger(__name__)


def file_order(files: Sequence[Path], seed: int | None, epoch: int) -> list[Path]:
    """The files of ``epoch``: as given without a seed, else a permutation seeded by ``(seed, epoch)``."""
    if seed is None:
        return list(files)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [files[i] for i in torch.randperm(len(files), generator=generator).tolist()]


def stream_documents(builder: str, files: Sequence[Path], where: str, seed: int | None, rows: int, row: int
                     ) -> Callable[[int], datasets.IterableDataset]:
    """``epoch -> the documents of stream row``: every ``rows``-th document from ``row`` of that epoch's file
    order (whole files per stream when the file count is a multiple of ``rows``: Hugging Face's split)."""
    def documents(epoch: int) -> datasets.IterableDataset:
        every = open_documents(builder, file_order(files, seed, epoch), where)
        return split_dataset_by_node(every, rank=row, world_size=rows)

    return documents


class RowStreams(torch.utils.data.IterableDataset):
    """This rank's rows of every global batch, one sequence at a time, in row order: ``(inputs, labels)``.

    ``streams``: ``{row: PackedTokenDataset}`` of the rows this rank owns. A ``StatefulDataLoader`` with
    ``batch_size = local_batch_size`` turns them into the step's accumulation batches.
    """

    def __init__(self, streams: dict[int, Any], total_rows: int) -> None:
        super().__init__()
        self.streams = dict(sorted(streams.items()))
        self.total_rows = total_rows  # rows of the global batch: a saved row position means nothing under another
        self._resume = False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self._resume:
            for stream in self.streams.values():
                stream._resume_on_next_iter = False  # a fresh iter() starts every stream over
        self._resume = False
        iterators = [iter(stream) for stream in self.streams.values()]
        while True:
            for it in iterators:
                yield next(it)

    # Loader state (same layout): every stream's state. Checkpoints store each stream on its own instead.
    def state_dict(self) -> dict[str, Any]:
        return {"streams": self.stream_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_stream_states(state_dict["streams"])

    def stream_states(self) -> dict[int, dict[str, Any]]:
        return {row: stream.state_dict() for row, stream in self.streams.items()}

    def load_stream_states(self, states: dict[int, dict[str, Any]]) -> None:
        missing = sorted(set(self.streams) - set(states))
        if missing:
            raise ConfigError(f"data: no saved position for rows {missing}; the global batch changed?")
        for row, stream in self.streams.items():
            stream.load_state_dict(states[row])
        self._resume = True


def owned_rows(rows: int, dp_rank: int, dp_size: int) -> range:
    """The global-batch rows a data-parallel rank reads: a contiguous block of ``rows / dp``."""
    if rows % dp_size:
        raise ConfigError(f"[training] global batch of {rows} sequences does not split over {dp_size} "
                          "data-parallel ranks; use a multiple of the data-parallel degree.")
    per_rank = rows // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
