"""Parallel degrees -> one DeviceMesh with named dimensions, checked before any process group exists."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import ModelArgs
from titan_simple.parallel.context_parallel import context_parallel_mesh
from titan_simple.parallel.torch_private import flatten_mesh

if TYPE_CHECKING:
    from titan_simple.config import JobConfig

# Outermost to innermost: pipeline stages talk least, tensor-parallel ranks most (keep them on one node); context
# parallel's per-layer key / value gathers sit between.
MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = whatever is left of the world size
    tp: int
    pp: int
    world_size: int
    cp: int = 1  # context parallel: ranks of one data-parallel group that split each sequence

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"[parallelism] {name} degree must be >= 1, got {getattr(self, name)}.")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"[parallelism] data_parallel_replicate_degree x context_parallel_degree x tensor_parallel_degree "
                    f"x pipeline_parallel_degree = {others} does not divide the world size {self.world_size}; "
                    f"launch a multiple of {others} processes or lower the degrees."
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if self.dp_shard < 1 or self.dp_shard * others != self.world_size:
            raise ConfigError(
                f"[parallelism] degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} x pp={self.pp} = {self.dp_shard * others} "
                f"but the world size is {self.world_size}; make the product equal the number of processes "
                f"(data_parallel_shard_degree = -1 fills in the rest)."
            )

    @classmethod
    def from_config(cls, config: JobConfig, world_size: int) -> ParallelDims:
        """The degrees of ``[parallelism]`` for ``world_size`` processes (raises the one-line error if they do
        not fit)."""
        parallelism = config.parallelism
        return cls(dp_replicate=parallelism.data_parallel_replicate_degree,
                   dp_shard=parallelism.data_parallel_shard_degree, tp=parallelism.tensor_parallel_degree,
                   pp=parallelism.pipeline_parallel_degree, world_size=world_size,
                   cp=parallelism.context_parallel_degree)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own rows of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def wraps_data_parallel(self) -> bool:
        """The data-parallel wrapper (SimpleFSDP or FSDP2: fully_shard, replicate or hybrid_shard) applies: data
        parallel, or context parallel (whose ranks hold the same weights and compute gradients of different
        tokens, so they shard the weights too)."""
        return self.dp * self.cp > 1

    @property
    def enabled_dims(self) -> dict[str, int]:
        """Mesh dimensions with degree > 1, in mesh order."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}
        return {name: sizes[name] for name in MESH_DIM_ORDER if sizes[name] > 1}

    @property
    def shard_degree(self) -> int:
        """How many ways SimpleFSDP shards each weight: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The mesh dimensions SimpleFSDP shards over: ``dp_shard``; with context parallel ``dp_shard_cp``, dp_shard
        and cp flattened (cp alone too: a group of its own, so the weights' collectives and the attention's
        key / value gathers stay apart in the comm plan and the dry run), or none."""
        if self.cp > 1:
            return ("dp_shard_cp",)
        return ("dp_shard",) if self.dp_shard > 1 else ()

    @property
    def data_parallel_mode(self) -> str:
        """SimpleFSDP mode implied by the degrees."""
        if self.dp_replicate > 1 and self.dp_shard * self.cp > 1:
            return "hybrid_shard"
        if self.dp_replicate > 1:
            return "replicate"
        return "fully_shard"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh over the enabled dimensions (None on a single process), with a flattened
        ``dp`` dimension (replicate x shard) for data loading and loss reduction."""
        dims = self.enabled_dims
        if not dims:
            return None
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        dp_names = tuple(name for name in ("dp_replicate", "dp_shard") if name in dims)
        if len(dp_names) == 2:
            flatten_mesh(mesh[dp_names], "dp")
        if self.shard_names == ("dp_shard_cp",):
            flatten_mesh(mesh[tuple(name for name in ("dp_shard", "cp") if name in dims)], "dp_shard_cp")
        return mesh

    def process_groups(self, mesh: DeviceMesh | None) -> list[ProcessGroup]:
        """This rank's process group of every mesh dimension (and of the flattened ``dp``), each once: what the
        run's collectives use besides the default group (``trainer/distributed.py`` sets their timeouts)."""
        if mesh is None:
            return []
        names = list(self.enabled_dims)
        if "dp_replicate" in names and "dp_shard" in names:
            names.append("dp")
        if self.shard_names == ("dp_shard_cp",):
            names.append("dp_shard_cp")
        groups = [mesh[name].get_group() for name in names]
        if self.cp > 1:  # the keys' and values' gathers have a group of their own where cp is the whole world
            groups.append(context_parallel_mesh(mesh).get_group())
        return list({id(group): group for group in groups}.values())

    @cached_property
    def describe(self) -> str:
        dims = self.enabled_dims
        return " x ".join(f"{name}{size}" for name, size in dims.items()) or "single process"


def validate_parallelism(dims: ParallelDims, model_args: ModelArgs, config: JobConfig) -> None:
    """Checks of the degrees against the model and the sequence length; no process group needed, so call it
    before creating one. Tensor parallel splits the attention heads (query and KV), the SwiGLU width and the
    vocabulary (embedding rows, output columns, loss-parallel logits) evenly, and sequence parallel splits
    every sequence; ``dim = n_heads x head_dim`` then divides too. Context parallel cuts every sequence into
    ``2 x cp`` equal chunks, and sequence parallel splits each rank's share again."""
    tp, cp, seq_len = dims.tp, dims.cp, config.training.seq_len
    if cp > 1 and seq_len % (2 * cp * tp):
        step = 2 * cp * tp
        raise ConfigError(
            f"[training] seq_len = {seq_len} is not a multiple of 2 x context_parallel_degree"
            f"{' x tensor_parallel_degree' if tp > 1 else ''} = {step}; context parallel cuts every sequence into "
            f"2 x {cp} equal chunks (head-tail balance){', which sequence parallel splits again' if tp > 1 else ''}, "
            f"so use e.g. {seq_len - seq_len % step + step}."
        )
    if tp == 1:
        return
    flavor = config.model.flavor
    sizes = {
        "n_heads": model_args.n_heads,
        "n_kv_heads": model_args.n_kv_heads,
        "SwiGLU hidden size": model_args.ffn_dim,
        "vocab_size": model_args.vocab_size,
    }
    common = math.gcd(*sizes.values())
    fitting = ", ".join(str(d) for d in range(1, min(common, 64) + 1) if common % d == 0)
    for what, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"[parallelism] tensor_parallel_degree = {tp} does not divide {what} = {size} of [model] "
                f"flavor '{flavor}'; tensor parallel splits it evenly, so use one of {fitting}."
            )
    if seq_len % tp:
        raise ConfigError(
            f"[training] seq_len = {seq_len} is not a multiple of [parallelism] tensor_parallel_degree = {tp}; "
            f"sequence parallel splits every sequence evenly, so use e.g. {seq_len - seq_len % tp + tp}."
        )


def tensor_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh["tp"]``, the same object at every call for one world mesh. Each slice is a new DeviceMesh, equal to
    the others, and torch 2.13's compiler does not tell equal meshes apart: a compiled block whose DTensor input
    lives on one ``tp`` object (a pipeline stage's received activation) and whose parameters on another mixes up
    their placeholders ("Node tangents_2 was invalid, but is output"; docs/parallelism.md). So tensor parallel and the
    pipeline's received activations use this one object."""
    world, tp = _TENSOR_PARALLEL_MESHES.get(id(mesh), (None, None))
    if world is not mesh:
        world, tp = _TENSOR_PARALLEL_MESHES[id(mesh)] = (mesh, mesh["tp"])  # holds the world: its id stays its own
    return tp


_TENSOR_PARALLEL_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def dp_mesh(mesh: DeviceMesh | None, dims: ParallelDims) -> DeviceMesh | None:
    """The sub-mesh SimpleFSDP works over: (dp_replicate, the shard dims) for HSDP, one of them, or None. The shard
    dims are dp_shard and cp (``ParallelDims.shard_names``)."""
    if mesh is None:
        return None
    names = (("dp_replicate",) if dims.dp_replicate > 1 else ()) + dims.shard_names
    if not names:
        return None
    return mesh[names]


def dp_rank_and_size(mesh: DeviceMesh | None, dims: ParallelDims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks (which slice of data it reads), and their count."""
    if mesh is None or not dims.dp_enabled:
        return 0, 1
    names = [n for n in ("dp_replicate", "dp_shard") if n in dims.enabled_dims]
    if len(names) == 2:
        return mesh["dp"].get_local_rank(), dims.dp
    return mesh[names[0]].get_local_rank(), dims.dp
