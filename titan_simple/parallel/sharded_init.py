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
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

_RANDOM_INPLACE_OPS = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default}


class layout_invariant_init(TorchDispatchMode):
    """Context manager: random in-place init of DTensors behaves as if the tensor were not sharded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in _RANDOM_INPLACE_OPS and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            func(full, *args[1:], **kwargs)
            # src_data_rank=None: every rank holds the same full tensor, so slice locally, no broadcast.
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
            return target
        return func(*args, **kwargs)
