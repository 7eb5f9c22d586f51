"""Random initialization of sharded parameters that does not depend on the parallel layout.

Run a model's ordinary ``init_weights()`` on DTensor parameters and each rank draws random numbers for
its local shard alone: on CPU every shard gets the *same* numbers (DTensor's RNG tracker supports only
CUDA-like devices), and on any device the result differs from a single-process run. Both break what we
promise: the same seed gives the same model on 1 process and on N, whatever the layout.

``layout_invariant_init()`` intercepts the in-place random ops (``uniform_``, ``normal_``) that reach a
DTensor, draws the numbers for the *whole* tensor from the global generator exactly as a single process
would, and keeps this rank's part. The deterministic ops that follow (``erfinv_``, ``mul_``, ``clamp_``
of ``trunc_normal_``) run on the shards as usual. The cost is one transient unsharded copy of the
parameter being initialized (the largest is Llama 3 405B's output projection, 8.4 GB in fp32), paid
once at start-up, and no communication.

``layout_invariant_init(model, seed)`` also makes the numbers independent of *which* modules exist: the
first random fill of each parameter of ``model`` reseeds the generator from ``(seed, parameter name)``. A
pipeline stage holding layers 3-5 then draws for them what the whole model draws, although it lacks the
embedding whose draws would come first. The trainer initializes every layout this way (one process
included), so all layouts start from the same weights; these differ from a plain seeded ``init_weights()``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_simple.parallel.simple_fsdp import sharded_parameters
from titan_simple.parallel.torch_private import TorchDispatchMode

_RANDOM_INPLACE_OPS = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default}


def parameter_seed(seed: int, name: str) -> int:
    """A seed for one parameter: the same on every process and every run (unlike Python's ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class layout_invariant_init(TorchDispatchMode):
    """Context manager: random in-place init of DTensors behaves as if the tensor were not sharded; with a
    ``model`` and ``seed``, each parameter of ``model`` is drawn from its own seed (see the module doc)."""

    def __init__(self, model: nn.Module | None = None, seed: int | None = None) -> None:
        super().__init__()
        if (model is None) != (seed is None):
            raise ValueError("layout_invariant_init: give both model and seed, or neither.")
        self._names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self._seed = seed
        self._seeded: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in _RANDOM_INPLACE_OPS and id(target) in self._names and id(target) not in self._seeded:
            # The parameter's first draw; its later ones (and trunc_normal_'s redraws into temporaries,
            # which depend on the values) continue from this seed.
            self._seeded.add(id(target))
            torch.manual_seed(parameter_seed(self._seed, self._names[id(target)]))
        if func in _RANDOM_INPLACE_OPS and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            func(full, *args[1:], **kwargs)
            # src_data_rank=None: every rank holds the same full tensor, so slice locally, no broadcast.
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
            return target
        return func(*args, **kwargs)


def materialize_and_init(model: nn.Module, device: torch.device, seed: int) -> None:
    """The trainer's recipe for a model (or pipeline stage) parallelized on the meta device: ``to_empty``,
    then ``init_weights`` writing straight into the shards, each parameter drawn from ``(seed, its name)``."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad(), sharded_parameters(), layout_invariant_init(model, seed):
        model.init_weights(buffer_device=device)
    model.train()
