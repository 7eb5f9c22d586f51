"""Regional compilation's regions: what each compiled region runs, how its collectives are bucketed, and the
hand-off that lets a region gather the next region's first weights.

A region is ``regional_blocks`` consecutive transformer blocks (``BlockRegion``); the last one also runs the final
norm and output projection. The token embedding runs before them as a small region of its own
(``EmbeddingRegion``). ``RegionalForward`` runs them in order in place of ``Transformer.forward_modules``
(``run_in_regions`` swaps the model's class for one that does). Every region of one shape shares one compiled
code (``compile.CompilePlan.compile_regional``): the embedding's, the blocks', the last region's.

**Why a hand-off.** Nothing in a compiled graph overlaps what runs before or after it. A region left to itself
waits for its first all-gather before any compute, and for its first weights' reduce-scatter after all of its
backward. So each region but the last also all-gathers the next region's first weights (``HANDOFF_MODULES``:
the first block's attention norm and q / k / v projections) in its last bucket, while its last block computes,
and returns them (``HandoffGather``); the embedding's region does it for the first block region. The next region
computes with them (SimpleFSDP's ``_held_unsharded``) instead of gathering; autograd carries their gradients back
into this region's backward, which reduces them with its last bucket while the rest of its backward computes. A
region's backward then ends with the reduce-scatter of its first block's ``wo``, issued before the attention's
backward. What no region hides is its first backward re-gather (its last bucket: a w2, resharded after
forward). Every block region is handed its first weights, so all but the last share one code. The cost: the
handed-off weights stay unsharded from a region's forward to its backward (Llama 3 8B: 48 MiB per region). The
hand-off runs when SimpleFSDP gathers per microbatch without pipeline parallel (``CompilePlan.region_handoff``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from titan_simple.models.attention import KVCache, Mask
from titan_simple.parallel.simple_fsdp import gather_unsharded

# A region's buckets, by module name inside its first and last blocks (``region_bucket_plan``). The first
# bucket is the hand-off (gathered by the region before; a region without one gathers it itself). The last
# bucket is the last block's w2: its backward re-gather is the one collective of a region that nothing hides, so
# it is the smallest tail of a block.
HANDOFF_MODULES: tuple[str, ...] = ("attention_norm", "attention.wq", "attention.wk", "attention.wv")
FIRST_BLOCK_BUCKETS: tuple[tuple[str, ...], ...] = (
    HANDOFF_MODULES, ("attention.wo",), ("ffn_norm", "feed_forward"))
LAST_BLOCK_BUCKETS: tuple[tuple[str, ...], ...] = (
    ("attention_norm", "attention", "ffn_norm", "feed_forward.w1", "feed_forward.w3"), ("feed_forward.w2",))
ONE_BLOCK_BUCKETS: tuple[tuple[str, ...], ...] = (
    *FIRST_BLOCK_BUCKETS[:2], ("ffn_norm", "feed_forward.w1", "feed_forward.w3"), ("feed_forward.w2",))
EMBEDDING = "tok_embeddings"
# The final norm and output projection (the last region's) and the hand-off (every other region's) join the last
# bucket: their all-gathers run while the rest of the last block computes, their reductions during its backward.
HEAD_BUCKET: tuple[str, ...] = ("norm", "output")
HANDOFF = "handoff"
Handed = tuple[torch.Tensor, ...]  # what a region hands the next: its first modules' weights, gathered


class HandoffGather(nn.Module):
    """All-gathers the next region's first weights at the end of a region (see the module docstring). The
    next region's modules are registered here too, so they are inputs of this region's graph."""

    def __init__(self, receivers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.receivers = nn.ModuleList(receivers)

    def forward(self) -> Handed:
        # flat: a float8-gathered weight is two tensors (its gradient's stand-in and its float8 bits)
        return tuple(t for module in self.receivers for held in gather_unsharded(module).values()
                     for t in (held if isinstance(held, tuple) else (held,)))


class EmbeddingRegion(nn.Module):
    """The token embedding as a region of its own, before the block regions: with the hand-off it also gathers
    the first block region's first weights."""

    def __init__(self, tok_embeddings: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.handoff: HandoffGather | None = None

    def forward(self, tokens: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, Handed]:
        # freqs_cis and mask are unused: every region takes the same arguments (RegionalForward calls them alike).
        h = self.tok_embeddings(tokens)
        return h if self.handoff is None else (h, self.handoff())


class BlockRegion(nn.Module):
    """Consecutive transformer blocks that run as one compiled region, the last region followed by the final
    norm and output projection, every other one returning the next region's first weights (``handoff``). The
    regions stay outside the model's module tree (``run_in_regions`` keeps them on the model's class), so
    parameter names, state_dict and checkpoints stay as they are."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm: nn.Module | None = None
        self.output: nn.Module | None = None
        self.handoff: HandoffGather | None = None

    def forward(self, h: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, Handed]:
        for block in self.blocks:
            h = block(h, freqs_cis, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h if self.handoff is None else (h, self.handoff())


def block_regions(model: nn.Module, size: int) -> list[BlockRegion]:
    """``model``'s transformer blocks in regions of ``size`` consecutive blocks, the last region followed by the
    final norm and output projection where ``model`` (a pipeline stage) has them. Empty for a stage without
    blocks. No hand-off: ``RegionalForward`` adds it."""
    blocks = list(model.layers.values())
    regions = [BlockRegion(blocks[i : i + size]) for i in range(0, len(blocks), size)]
    if regions:
        regions[-1].norm, regions[-1].output = (getattr(model, name, None) for name in HEAD_BUCKET)
    return regions


def handoff_receivers(region: BlockRegion) -> list[nn.Module]:
    """The modules of ``region`` whose weights the region before it gathers (``HANDOFF_MODULES``)."""
    return bucket_modules(region.blocks[0], HANDOFF_MODULES)


class RegionalForward:
    """The model's modules run through its regions, in order: the embedding's (where the model has one) and the
    block regions. With ``handoff`` each region's gathered hand-off is held by the next region's first modules
    while that region runs. The embedding's region runs eagerly where its layouts are forward hooks (tensor
    parallel: compiled alone, the row-wise sharded embedding fails DTensor's sharding propagation in torch 2.13);
    the first block region then gathers its first weights itself (a code of its own, in place of the embedding's)."""

    def __init__(self, model: nn.Module, size: int, handoff: bool) -> None:
        self.regions: list[nn.Module] = list(block_regions(model, size))
        embedding = getattr(model, EMBEDDING, None)
        self.embedding_compiles = embedding is not None and not (embedding._forward_pre_hooks
                                                                  or embedding._forward_hooks)
        if embedding is not None and self.regions:
            self.regions.insert(0, EmbeddingRegion(embedding))
        self.receivers: list[list[nn.Module]] = [[] for _ in self.regions]
        if not handoff:
            return
        for i in range(1, len(self.regions)):
            before = self.regions[i - 1]
            if isinstance(before, EmbeddingRegion) and not self.embedding_compiles:
                continue
            self.receivers[i] = handoff_receivers(self.regions[i])
            before.handoff = HandoffGather(self.receivers[i])

    @property
    def compiled(self) -> list[nn.Module]:
        """The regions to compile: all but an embedding region that runs eagerly."""
        return [r for r in self.regions if self.embedding_compiles or not isinstance(r, EmbeddingRegion)]

    def __call__(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        handed: Handed = ()
        for region, receivers in zip(self.regions, self.receivers, strict=True):
            with _holding(receivers, handed):
                out = region(x, freqs_cis, mask)
            x, handed = out if region.handoff is not None else (out, ())
        return x


class _Regional:
    """What ``run_in_regions`` mixes into a model's class: ``forward_modules`` runs the class's ``regions``; with a
    generation cache, the plain modules."""

    regions: RegionalForward

    def forward_modules(self, tokens: torch.Tensor, freqs_cis: torch.Tensor, mask: Mask | None,
                        cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return super().forward_modules(tokens, freqs_cis, mask, cache)
        return self.regions(tokens, freqs_cis, mask)


def run_in_regions(model: nn.Module, regions: RegionalForward) -> None:
    """Swap ``model``'s class (a ``Transformer``) for a subclass of its own that runs ``regions`` in place of its
    modules: the regions live on that class, so the model's own attributes, parameters and state_dict stay as they
    are."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (_Regional, cls), {"regions": regions})


def regions_of(model: nn.Module) -> RegionalForward | None:
    """The regions ``model`` runs in (``run_in_regions``), or None."""
    return model.regions if isinstance(model, _Regional) else None


@contextlib.contextmanager
def _holding(modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """``modules`` compute with ``tensors`` (in ``gather_unsharded``'s order) instead of gathering, inside.
    A compiled region's graph takes them as inputs and saves what its backward needs, so they are dropped after
    the call."""
    values = iter(tensors)
    for module in modules:
        assert module._held_unsharded is None, "a module is held twice (regional hand-off and fsdp_gather?)"
        module._held_unsharded = {name: (next(values), next(values)) if spec.float8 is not None else next(values)
                                  for name, spec in module._gather_specs.items()}
    assert next(values, None) is None, "the hand-off gathered more weights than the next region reads"
    try:
        yield
    finally:
        for module in modules:
            module._held_unsharded = None


def region_bucket_plan(blocks: int) -> list[list[str]]:
    """The buckets of a region of ``blocks`` blocks, by module name inside the region: the first block's
    hand-off modules (none move in a region that is handed them; a region without a hand-off gathers them
    itself), the rest of that block in two (``FIRST_BLOCK_BUCKETS``), the middle blocks whole (as the whole-model
    plan), the last block but its w2, and its w2 (``LAST_BLOCK_BUCKETS``; ``ONE_BLOCK_BUCKETS`` for one block)
    with the final norm and output (the last region's) or the next region's hand-off. The embedding's region
    finds the embedding in the first bucket and its hand-off in the last. A name a region lacks (a shorter
    region, at the end of a depth or of a pipeline stage that is not a multiple of ``blocks``; the embedding or
    head of another region) finds no module: a shorter region's last bucket is whatever its last block's names
    find."""
    def named(index: int, buckets: tuple[tuple[str, ...], ...]) -> list[list[str]]:
        return [[f"blocks.{index}.{name}" for name in bucket] for bucket in buckets]

    if blocks == 1:
        plan = named(0, ONE_BLOCK_BUCKETS)
    else:
        middle = [[f"blocks.{i}"] for i in range(1, blocks - 1)]
        plan = named(0, FIRST_BLOCK_BUCKETS) + middle + named(blocks - 1, LAST_BLOCK_BUCKETS)
    plan[0] = [EMBEDDING, *plan[0]]
    plan[-1] += [*HEAD_BUCKET, HANDOFF]
    return plan


def bucket_modules(region: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules of ``region`` that one bucket of ``region_bucket_plan`` names (none for a name the region
    lacks)."""
    found = []
    for name in names:
        try:
            found.append(region.get_submodule(name))
        except AttributeError:  # a name past a shorter region's end, or a module it does not run (None)
            continue
    return found
