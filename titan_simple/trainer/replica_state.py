"""What replica groups move between them: the state a healing group receives (``ReplicaState``), its size and the
time a transfer of it may take (``state_bytes``, ``recovery_timeout``), and the gradient buffer the groups average
in (``GradientBuckets``). ``fault_tolerance.py`` drives them through torchft."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_simple.trainer.loop_feature import Progress


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaState:
    """What a healing group receives from a live one, rank by rank: this rank's shards of the parameters and of
    the optimizer state, the optimizer's hyperparameters (the LR the schedule set), the schedule and the loop's
    ``Progress`` (step, tokens, data position). Shards travel as plain local tensors (the layouts are the same in
    every group)."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 progress: Callable[[], Progress]) -> None:
        self.params, self.optimizer, self.lr_scheduler, self.progress = params, optimizer, lr_scheduler, progress

    def state_dict(self) -> dict[str, Any]:
        with torch.no_grad():
            optimizer_state = [
                {key: (_local(value), isinstance(value, DTensor)) for key, value in self.optimizer.state[p].items()}
                for p in self.params
            ]
            return {
                "params": [_local(p).detach() for p in self.params],  # plain tensors, for torchft's transport
                "optimizer": optimizer_state,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "progress": dict(vars(self.progress())),
            }

    def load_state_dict(self, state: dict[str, Any]) -> Progress:
        with torch.no_grad():
            for p, shard in zip(self.params, state["params"], strict=True):
                _local(p).copy_(shard)
            for p, entries in zip(self.params, state["optimizer"], strict=True):
                mine = self.optimizer.state[p]
                for key, (shard, distributed) in entries.items():
                    if key in mine:
                        _local(mine[key]).copy_(shard)
                    elif distributed:  # a fresh optimizer has no state yet: shard it like its parameter
                        mine[key] = DTensor.from_local(shard.to(p.device).clone(), p.device_mesh, p.placements,
                                                       run_check=False, shape=p.shape, stride=p.stride())
                    else:
                        mine[key] = shard.clone()
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group.update(saved)
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return Progress(**state["progress"])

    def digests(self) -> dict[str, str]:
        """A hash of this rank's parameter shards and one of its optimizer shards (``log_shard_hashes``)."""
        params, optimizer = hashlib.sha256(), hashlib.sha256()
        for p in self.params:
            params.update(_tensor_bytes(_local(p.detach())))
            for key in sorted(self.optimizer.state[p]):
                value = self.optimizer.state[p][key]
                if isinstance(value, torch.Tensor):
                    optimizer.update(_tensor_bytes(_local(value)))
        return {"params": params.hexdigest(), "optimizer": optimizer.hexdigest()}


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def state_bytes(state_dict: Any) -> int:
    """The bytes of every tensor in ``state_dict`` (nested dicts, lists and tuples)."""
    if isinstance(state_dict, torch.Tensor):
        return _local(state_dict).numel() * state_dict.element_size()
    if isinstance(state_dict, dict):
        return sum(state_bytes(v) for v in state_dict.values())
    if isinstance(state_dict, list | tuple):
        return sum(state_bytes(v) for v in state_dict)
    return 0


def recovery_timeout(nbytes: int, timeout_seconds: float, gb_per_second: float) -> timedelta:
    """How long a heal of ``nbytes`` may take: the per-operation timeout plus the transfer at the slowest allowed rate
    (``[fault_tolerance] heal_gb_per_second``). torchft bounds the whole heal -- send, metadata, receive -- by it."""
    return timedelta(seconds=timeout_seconds + nbytes / (gb_per_second * 1e9))


class GradientBuckets:
    """The gradient shards of a rank, living in one flat buffer per dtype, all-reduced across the groups in slices
    of at most ``cap_bytes`` (one all-reduce per slice, all in flight at once).

    On the first step (and after anything freed them: an uncommitted step's ``zero_grad``) each gradient is copied
    into its place in the buffer and the parameter's ``.grad`` becomes a view of it; from then on autograd (and
    SimpleFSDP's once-per-step reduce) accumulates into those views, the step zeroes them in place
    (``TrainStep.keep_grad_buffers``), and averaging copies nothing. ``in_bf16``: a persistent bf16 buffer the fp32
    gradients are cast into and back from instead (half the bytes between groups)."""

    def __init__(self, cap_bytes: int, in_bf16: bool = False) -> None:
        self.cap_bytes, self.in_bf16 = cap_bytes, in_bf16
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.bf16: torch.Tensor | None = None  # in_bf16: the buffer the all-reduces run on
        self._views: list[torch.Tensor] = []  # this rank's gradient shards, views of self.flats
        self._params: list[torch.nn.Parameter] = []

    def _in_place(self, params: list[torch.nn.Parameter]) -> bool:
        return params == self._params and all(
            _local(p.grad).data_ptr() == view.data_ptr() for p, view in zip(params, self._views, strict=True))

    def _adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Put every gradient in its place in the flat buffers and make ``.grad`` a view of it."""
        sizes: dict[torch.dtype, int] = {}
        for p in params:
            sizes[p.grad.dtype] = sizes.get(p.grad.dtype, 0) + _local(p.grad).numel()
        if {d: t.numel() for d, t in self.flats.items()} != sizes:
            self.flats = {dtype: torch.empty(n, dtype=dtype, device=params[0].grad.device)
                          for dtype, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self._views = []
        with torch.no_grad():
            for p in params:
                local = _local(p.grad)
                start = offsets[local.dtype]
                view = self.flats[local.dtype][start:start + local.numel()].view(local.shape)
                offsets[local.dtype] = start + local.numel()
                view.copy_(local)
                p.grad = (DTensor.from_local(view, p.grad.device_mesh, p.grad.placements, run_check=False,
                                             shape=p.grad.shape, stride=p.grad.stride())
                          if isinstance(p.grad, DTensor) else view)
                self._views.append(view)
        self._params = list(params)

    def buffers(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The flat buffers to all-reduce this step, with ``params``' gradients in them."""
        if not self._in_place(params):
            self._adopt(params)
        if not self.in_bf16:
            return list(self.flats.values())
        total = sum(t.numel() for t in self.flats.values())
        if self.bf16 is None or self.bf16.numel() != total:
            self.bf16 = torch.empty(total, dtype=torch.bfloat16, device=self._views[0].device)
        offset = 0
        for flat in self.flats.values():
            self.bf16[offset:offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        return [self.bf16]

    def finish(self) -> None:
        """After the all-reduces: bring a bf16 average back into the gradients."""
        if self.in_bf16 and self.bf16 is not None:
            offset = 0
            for flat in self.flats.values():
                flat.copy_(self.bf16[offset:offset + flat.numel()])
                offset += flat.numel()

    def slices(self, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        step = max(1, self.cap_bytes // buffer.element_size())
        yield from buffer.split(step)
