"""What ``[compile]`` means for one run, and the calls that carry it out: ``CompilePlan``.

``core/plan.py`` decides the plan (the mode for this layout, bucketing, reordering, regional regions, compile
once); the recipe (``parallel/parallelize.py``) and the build (``core/build.py``, for the model with its loss)
call its methods. This module imports no Inductor: an eager run reads the plan and never compiles, so the
compiler (``compile/compiler.py``, ``compile/inductor_private.py``, about a second of each process's start) is
imported when the first compile runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from titan_simple.compile.comm_plan import CommPlanRecorder
    from titan_simple.compile.once import CompileOnce

# The compile fingerprint's part that holds a CPU run's thread count (Inductor keys CPU kernels by it).
CPU_THREADS = "CPU threads per process"


def _compiler() -> ModuleType:
    """``compile/compiler.py``, imported at the first compile (it imports Inductor)."""
    return importlib.import_module("titan_simple.compile.compiler")


def _inductor_private() -> ModuleType:
    return importlib.import_module("titan_simple.compile.inductor_private")


@dataclass(frozen=True)
class CompilePlan:
    """What ``[compile]`` means for this run (decided by ``core/plan.py``).

    ``mode``: ``off``; ``whole`` (the model, or each pipeline stage, is one graph, collectives included);
    ``whole_with_loss`` (the build compiles the model and its loss as one graph, ``core/loss.ModelWithLoss``);
    ``per_block`` (each transformer block on its own: FSDP2, TP inside multi-stage pipelines, zero-bubble
    schedules; no whole-step graph to bucket or reorder); ``regional`` (``[compile] regional``: the transformer
    blocks share one compiled code, which buckets and reorders their collectives; the last region runs the norm
    and output too; the embedding compiles as a small region of its own, or runs eagerly under tensor parallel)."""

    mode: str = "off"
    backend: str = "inductor"
    bucketing: str = "transformer_block"
    manual_plan: tuple[str | tuple[str, ...], ...] = ()
    reorder: bool = True
    dump_folder: str | None = None
    # Where torch's compile caches live for this run ([compile] cache_dir; compile_cache.use_compile_cache).
    cache_dir: str = ""
    # Names this run's graphs for the comm plan's copy in the compile cache (core/plan.py; "" = keep none).
    fingerprint: str = ""
    # The fingerprint's named parts (model, layout, torch, code, ...), each hashed: why a start compiles again.
    fingerprint_parts: tuple[tuple[str, str], ...] = ()
    async_tensor_parallel: bool = False  # Inductor's micro-pipelined TP (CUDA only; core/plan.py checks)
    region_blocks: int = 1  # regional: consecutive transformer blocks compiled as one region
    # regional: each region gathers the next region's first weights (regions.py; SimpleFSDP gathering per
    # microbatch, no pipeline parallel: core/plan.py)
    region_handoff: bool = False
    # Inductor rounds through each low-precision cast as eager does, so a recomputed value equals the forward's
    # (rowwise float8: core/plan.py)
    emulate_precision_casts: bool = False
    # One rank of each class compiles each graph and the others load it (compile/once.py): a multi-rank Inductor
    # compile with [compile] compile_on_one_rank.
    once: bool = False

    def inductor_options(self) -> dict[str, Any]:
        """The Inductor settings of this compile that do not depend on the graph (``compile_model`` adds its
        post-grad pass): the ones that keep a compile from talking to other ranks (``rank_local_compile_options``:
        pipeline stages compile one after another), async tensor parallel's pass, and precision-cast emulation."""
        if self.backend != "inductor":
            return {}
        private = _inductor_private()
        return {**private.rank_local_compile_options(),
                **(private.async_tensor_parallel_options() if self.async_tensor_parallel else {}),
                **({"emulate_precision_casts": True} if self.emulate_precision_casts else {})}

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def whole_graph(self) -> bool:
        """One graph for the model or stage (with or without the loss): Inductor sees the collectives."""
        return self.mode in ("whole", "whole_with_loss")

    def compile_whole(self, module: nn.Module, plan_root: str = "") -> CommPlanRecorder | None:
        """Compile ``module`` in place as one graph with this plan's bucketing and reordering; ``plan_root``
        names the submodule holding the transformer blocks when ``module`` wraps the model."""
        return _compiler().compile_model(
            module, backend=self.backend, bucketing=self.bucketing, manual_plan=self.manual_plan or None,
            reorder=self.reorder, dump_folder=self.dump_folder, plan_root=plan_root,
            extra_options=self.inductor_options(), fingerprint=self.fingerprint, session=self.session())

    def compile_regional(self, model: nn.Module) -> CommPlanRecorder | None:
        """Regional compilation: group ``model``'s transformer blocks into regions of ``region_blocks``
        consecutive blocks (``regions.BlockRegion``, the last one followed by the final norm and output
        projection), after the embedding's own region; the model's class is swapped for one that runs them
        (``regions.run_in_regions``). Every region compiles with one shared pass, so Dynamo reuses a region's
        graphs for every other region of its shape (their guards pass: same classes, shapes and settings) and
        compile time hardly grows with depth: three codes, the embedding's, the blocks' and the last region's.
        The pass buckets each region's collectives (``region_bucket_plan``) and, with reorder, issues each
        bucket's all-gather while the bucket before it computes (in backward, each reduce-scatter runs while the
        bucket after it computes). With ``region_handoff`` each region also gathers the next region's first
        weights, so that their collectives overlap too (``regions.py``)."""
        from titan_simple.compile.regions import (
            EMBEDDING,
            HEAD_BUCKET,
            RegionalForward,
            region_bucket_plan,
            run_in_regions,
        )

        size = self.region_blocks
        forward = RegionalForward(model, size, handoff=self.region_handoff)
        if not forward.regions:
            # A pipeline stage without blocks: its embedding, norm and output compile alone, or run eagerly under
            # tensor parallel (their layouts are forward hooks; compiled alone, the row-wise sharded embedding
            # fails DTensor's sharding propagation in torch 2.13).
            for name in (EMBEDDING, *HEAD_BUCKET):
                module = getattr(model, name, None)
                if module is not None and not (module._forward_pre_hooks or module._forward_hooks):
                    self._compile_forward(module)
            return None
        run_in_regions(model, forward)
        regions = forward.compiled
        first = _REGIONAL_COMPILES.get(self)
        if first is not None:  # another pipeline stage of this rank: the same options, so the same code
            for region in regions:
                region.compile(fullgraph=True, **first.compile_kwargs)
            return first
        plan = region_bucket_plan(size) if self.bucketing == "transformer_block" else None
        recorder = _compiler().compile_model(
            model, backend=self.backend, bucketing=self.bucketing, manual_plan=plan, reorder=self.reorder,
            dump_folder=self.dump_folder, extra_options=self.inductor_options(), fingerprint=self.fingerprint,
            modules=regions, session=self.session())
        if recorder is not None:
            _REGIONAL_COMPILES[self] = recorder
        return recorder

    def _compile_forward(self, module: nn.Module) -> None:
        """Compile ``module``'s forward in place, through a function of ours: Dynamo skips the frames of torch's
        own modules (``nn.Embedding``, ``nn.Linear``, ...) when their ``_call_impl`` is compiled directly
        ("found no compiled frames"), but inlines them from ours. The module's class is swapped for a subclass
        whose forward is the compiled one (nothing is set on the module). Forward hooks would stay outside."""
        _inductor_private().prepare_compile()
        cls = type(module)
        compiled = torch.compile(_forward_of(cls), fullgraph=True, **self.backend_kwargs(self.inductor_options()))
        module.__class__ = type(cls.__name__, (cls,), {"forward": _calling(compiled)})

    def compile_block(self, block: nn.Module) -> None:
        """Compile one transformer block in place (``per_block`` mode): no collective passes, only the
        graph-independent options."""
        _inductor_private().prepare_compile()
        block.compile(fullgraph=True, **self.backend_kwargs(self.inductor_options()))

    def session(self) -> CompileOnce | None:
        """This process's compile-once session when the plan compiles once (``compile/once.py``)."""
        if not (self.once and self.backend == "inductor"):
            return None
        return importlib.import_module("titan_simple.compile.once").active_session()

    def backend_kwargs(self, options: dict[str, Any]) -> dict[str, Any]:
        """``torch.compile``'s backend arguments for ``options``: Inductor with them, through the compile-once
        session when there is one."""
        session = self.session()
        if session is not None:
            return {"backend": session.backend(options)}
        return {"backend": self.backend, **({"options": options} if options else {})}


_REGIONAL_COMPILES: dict[CompilePlan, CommPlanRecorder] = {}  # the first regional compile of each plan


def _forward_of(cls: type[nn.Module]) -> Callable[..., Any]:
    """``cls``'s forward as a function of ours, the frame ``CompilePlan._compile_forward`` compiles."""

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return cls.forward(module, *args, **kwargs)

    return forward


def _calling(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A forward method that calls ``compiled(module, ...)``."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return compiled(self, *args, **kwargs)

    return forward
