"""Each matrix whole on one owner rank, and the owners' results back as shards: what an optimizer needs that works on
whole matrices (Muon's Newton-Schulz orthogonalization) while every rank holds only a block of each.

A parameter sharded by SimpleFSDP, FSDP2 or tensor parallel is a DTensor: each rank of its mesh holds one rectangular
block of the global matrix (rows, and under tensor parallel columns too; ranks of another replica group hold the same
blocks). ``MatrixOwners`` gives every matrix one owner among the ranks of its mesh, balancing the work (a cost per
matrix, e.g. its Newton-Schulz FLOPs) over them, and plans two all-to-alls per step:

* ``gather``: every distinct block of a matrix goes once to the matrix's owner (replicas send nothing), which
  assembles the whole matrix;
* ``scatter``: each owner cuts its results into the blocks every rank of the mesh holds, replicas included.

Both are one (functional) ``all_to_all_single`` over the default process group, with zero-length exchanges between
ranks that share no matrix (another pipeline stage's ranks): one collective each per step, whatever the layout. The
dry run traces and prices them like any collective. Every rank computes
the blocks of its peers from the placements (no communication), so all compute the same owners and plan. Plain
tensors (one process) are their own owner: nothing moves.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_simple.parallel.torch_private import all_to_all_single, local_shape_and_offset, wait_tensor

logger = logging.getLogger(__name__)

Block = tuple[int, int, int, int]  # first row, rows, first column, columns of the global matrix


@dataclass(frozen=True)
class _Transfer:
    """One block of one matrix moving between two ranks."""

    matrix: int
    block: Block


def _blocks_of(param: torch.Tensor) -> dict[int, Block]:
    """The block of the global matrix each rank of its mesh holds, by rank (computed from the placements: no
    communication); a plain tensor is whole on this rank."""
    if not isinstance(param, DTensor):
        return {dist.get_rank() if dist.is_initialized() else 0: (0, param.shape[0], 0, param.shape[1])}
    mesh, blocks = param.device_mesh, {}
    for coordinate in itertools.product(*(range(size) for size in mesh.shape)):
        (rows, cols), (row, col) = local_shape_and_offset(param, coordinate)
        blocks[int(mesh.mesh[coordinate])] = (row, rows, col, cols)
    return blocks


def assign_owners(costs: list[float], ranks: tuple[int, ...]) -> list[int]:
    """Each matrix's owner among ``ranks``: the costliest matrix first, to the least loaded rank (the lowest on a
    tie), so every rank that computes it gets the same answer."""
    load = dict.fromkeys(ranks, 0.0)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(ranks, key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += costs[index]
    return owners


class MatrixOwners:
    """Owners of ``params`` (2-D tensors or DTensors, the same list in the same order on every rank of a mesh) and the
    exchanges that move them whole to their owners and back. ``costs``: the work per matrix that owners balance."""

    def __init__(self, params: list[torch.Tensor], costs: list[float]) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.shapes = [tuple(p.shape) for p in params]
        self.dtype = params[0].dtype if params else torch.float32  # of the updates that travel to the owners
        self.device = _local_device(params[0]) if params else torch.device("cpu")
        blocks = [_blocks_of(p) for p in params]
        self.local_blocks = [b[self.rank] for b in blocks]
        self.peers = [tuple(b) for b in blocks]  # the ranks holding a block of each matrix
        by_mesh: dict[tuple[int, ...], list[int]] = {}
        for index, ranks in enumerate(self.peers):
            by_mesh.setdefault(ranks, []).append(index)
        self.owners = [0] * len(params)
        for ranks, indices in by_mesh.items():
            for index, owner in zip(indices, assign_owners([costs[i] for i in indices], ranks), strict=True):
                self.owners[index] = owner
        self.costs = costs
        everyone = [{i: b[rank] for i, b in enumerate(blocks) if rank in b} for rank in range(self.world)]
        self.sends, self.receives = self._gather_plan(everyone)
        self.returns, self.arrivals = self._scatter_plan(everyone)

    @property
    def owned(self) -> list[int]:
        """The matrices this rank orthogonalizes (owns)."""
        return [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def _gather_plan(self, everyone: list[dict[int, Block]]) -> tuple[dict[int, list[_Transfer]],
                                                                        dict[int, list[_Transfer]]]:
        """What this rank sends to each owner, and (as an owner) receives from each rank: each distinct block of a
        matrix comes from the lowest rank that holds it."""
        sends: dict[int, list[_Transfer]] = {r: [] for r in range(self.world)}
        receives: dict[int, list[_Transfer]] = {r: [] for r in range(self.world)}
        for matrix in range(len(self.shapes)):
            senders: dict[Block, int] = {}
            for rank, blocks in enumerate(everyone):
                if matrix in blocks and blocks[matrix][1] * blocks[matrix][3] > 0:
                    senders.setdefault(blocks[matrix], rank)
            owner = self.owners[matrix]
            for block, sender in senders.items():
                if sender == self.rank:
                    sends[owner].append(_Transfer(matrix, block))
                if owner == self.rank:
                    receives[sender].append(_Transfer(matrix, block))
        return sends, receives

    def _scatter_plan(self, everyone: list[dict[int, Block]]) -> tuple[dict[int, list[_Transfer]],
                                                                         dict[int, list[_Transfer]]]:
        """What this rank (as an owner) returns to each rank holding a block of its matrices, and receives back."""
        returns: dict[int, list[_Transfer]] = {r: [] for r in range(self.world)}
        arrivals: dict[int, list[_Transfer]] = {r: [] for r in range(self.world)}
        for matrix in range(len(self.shapes)):
            owner = self.owners[matrix]
            for rank, blocks in enumerate(everyone):
                if matrix not in blocks or blocks[matrix][1] * blocks[matrix][3] == 0:
                    continue
                if owner == self.rank:
                    returns[rank].append(_Transfer(matrix, blocks[matrix]))
                if rank == self.rank:
                    arrivals[owner].append(_Transfer(matrix, blocks[matrix]))
        return returns, arrivals

    def gather(self, local: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``local[i]``: this rank's block of matrix ``i``. Returns the whole matrices this rank owns."""
        whole = {i: local[i].new_empty(self.shapes[i]) for i in self.owned}
        for transfer, piece in self._exchange(self.sends, self.receives, lambda t: local[t.matrix], self.dtype):
            row, rows, col, cols = transfer.block
            whole[transfer.matrix][row:row + rows, col:col + cols] = piece.reshape(rows, cols)
        return whole

    def scatter(self, whole: dict[int, torch.Tensor], like: list[torch.Tensor], dtype: torch.dtype
                ) -> list[torch.Tensor]:
        """The owners' ``whole`` results (in ``dtype``, the same on every rank: what travels) cut back into this
        rank's blocks, shaped and typed like ``like[i]``."""
        out = [torch.empty_like(t) for t in like]

        def block_of_whole(transfer: _Transfer) -> torch.Tensor:
            row, rows, col, cols = transfer.block
            return whole[transfer.matrix][row:row + rows, col:col + cols]

        for transfer, piece in self._exchange(self.returns, self.arrivals, block_of_whole, dtype):
            out[transfer.matrix].copy_(piece.reshape(out[transfer.matrix].shape))
        return out

    def _exchange(self, outgoing: dict[int, list[_Transfer]], incoming: dict[int, list[_Transfer]],
                  piece_of: Callable[[_Transfer], torch.Tensor], dtype: torch.dtype
                  ) -> list[tuple[_Transfer, torch.Tensor]]:
        """One all-to-all in ``dtype``: ``outgoing[r]``'s pieces (``piece_of(transfer)``) to rank ``r``, in matrix
        order; returns the pieces of ``incoming`` with their transfers."""
        if self.world == 1:
            return [(t, piece_of(t)) for t in outgoing[0]]
        send = [piece_of(t).reshape(-1).to(dtype) for r in range(self.world) for t in outgoing[r]]
        send_buffer = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=self.device)
        in_splits = [sum(t.block[1] * t.block[3] for t in outgoing[r]) for r in range(self.world)]
        out_splits = [sum(t.block[1] * t.block[3] for t in incoming[r]) for r in range(self.world)]
        # the functional collective: the dry run's tracer sees it (and prices it) like every other one
        receive_buffer = wait_tensor(all_to_all_single(send_buffer, out_splits, in_splits, dist.group.WORLD))
        pieces, start = [], 0
        for r in range(self.world):
            for transfer in incoming[r]:
                size = transfer.block[1] * transfer.block[3]
                pieces.append((transfer, receive_buffer[start:start + size]))
                start += size
        return pieces

    def describe(self) -> str:
        """Who owns how many matrices, and how balanced their work is (the largest load over the mean)."""
        loads: dict[int, float] = {}
        counts: dict[int, int] = {}
        for owner, cost in zip(self.owners, self.costs, strict=True):
            loads[owner] = loads.get(owner, 0.0) + cost
            counts[owner] = counts.get(owner, 0) + 1
        mean = sum(loads.values()) / max(len(loads), 1)
        per_rank = ", ".join(f"rank {r}: {counts[r]}" for r in sorted(counts))
        return (f"{len(self.owners)} matrices, each orthogonalized on one owner ({per_rank}); the largest owner's "
                f"FLOPs are {max(loads.values(), default=0) / mean if mean else 1:.2f}x the mean")


def _local_device(param: torch.Tensor) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device
