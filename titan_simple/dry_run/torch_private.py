"""The private torch APIs of the dry run (``titan_simple.dry_run``), all imported here; the dry run's other modules
import them from this one (checked with torch 2.13: ``tests/test_torch_private.py`` checks every ``PRIVATE_APIS``
entry and that no other module of the package imports a private torch name).

The dry run traces one rank's step on meta tensors under a dispatch mode: it tells fake tensors apart, walks nested
arguments, and hides the ops DTensor runs only to learn output shapes (``tracer.ignoring_shape_propagation``).
"""

from __future__ import annotations

import torch.distributed.tensor._sharding_prop as sharding_prop
import torch.utils._pytree as pytree
from torch._subclasses import fake_tensor

from titan_simple.parallel.torch_private import TorchDispatchMode

# --- re-exports: the names the rest of the package imports ------------------------------------------------
FakeTensor = fake_tensor.FakeTensor
ShardingPropagator = sharding_prop.ShardingPropagator
tree_leaves = pytree.tree_leaves

__all__ = ["FakeTensor", "ShardingPropagator", "TorchDispatchMode", "tree_leaves"]

# (owner, attribute, why we need it). The guard test checks each one with hasattr on the owner.
PRIVATE_APIS: tuple[tuple[object, str, str], ...] = (
    (fake_tensor, "FakeTensor", "tracer.py: ops on fake tensors are the tracer's own, not the step's"),
    (sharding_prop, "ShardingPropagator", "tracer.py: DTensor's sharding propagation"),
    (sharding_prop.ShardingPropagator, "_propagate_tensor_meta_non_cached",
     "tracer.ignoring_shape_propagation: the ops DTensor runs only to learn output shapes"),
    (pytree, "tree_leaves", "tracer.py: the tensors of an op's nested arguments and outputs"),
)
