"""The mesh as the dry run prices it: each dimension's size and whether its groups stay inside a node, and which
mesh dimension each process group is."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from titan_simple.parallel.context_parallel import context_parallel_mesh
from titan_simple.parallel.dims import MESH_DIM_ORDER, ParallelDims


@dataclass(frozen=True)
class MeshDim:
    name: str
    size: int
    intra_node: bool  # every member of one group on the same node


def mesh_dims(dims: ParallelDims, gpus_per_node: int) -> dict[str, MeshDim]:
    """Each enabled mesh dimension (and the flattened ``dp``), with whether its groups stay inside a node.
    Ranks are laid out with the last mesh dimension fastest, so a dimension's group spans ``stride x size``
    consecutive ranks, ``stride`` being the product of the dimensions after it."""
    enabled = dims.enabled_dims
    out: dict[str, MeshDim] = {}
    stride = 1
    for name in reversed(MESH_DIM_ORDER):
        if name in enabled:
            out[name] = MeshDim(name, enabled[name], stride * enabled[name] <= gpus_per_node)
            stride *= enabled[name]
    if "dp_replicate" in enabled and "dp_shard" in enabled:
        span = dims.dp * dims.cp * enabled.get("tp", 1)
        out["dp"] = MeshDim("dp", dims.dp, span <= gpus_per_node)
    if dims.shard_names == ("dp_shard_cp",):  # adjacent dimensions: one block of consecutive ranks per group
        span = dims.shard_degree * enabled.get("tp", 1)
        out["dp_shard_cp"] = MeshDim("dp_shard_cp", dims.shard_degree, span <= gpus_per_node)
    return out


def group_names(mesh: DeviceMesh | None, dims: ParallelDims) -> dict[str, str]:
    """c10d group name -> mesh dimension name."""
    names: dict[str, str] = {}
    if mesh is None:
        return names
    for name in dims.enabled_dims:
        names[mesh.get_group(name).group_name] = name
    if dims.cp > 1:  # the keys' and values' gathers may have a group of their own
        names[context_parallel_mesh(mesh).get_group().group_name] = "cp"
    if "dp_replicate" in dims.enabled_dims and "dp_shard" in dims.enabled_dims:
        names[mesh["dp"].get_group().group_name] = "dp"
    if dims.shard_names == ("dp_shard_cp",):
        names[mesh["dp_shard_cp"].get_group().group_name] = "dp_shard_cp"
    return names
