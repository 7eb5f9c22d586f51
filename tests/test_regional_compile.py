"""Regional compilation (``[compile] regional``, issue 21): one compiled code for every region of blocks.

One set of 2 gloo processes trains test_pipeline's recipe (6-layer debug model, fp32, 10 AdamW steps with
clipping active) through the trainer's own build and step, with the default 2 blocks per region:

* SimpleFSDP fully_shard over 2 ranks, compiled regionally, matches the single-process reference (losses and
  gradient norms). Dynamo compiles 3 frames: the embedding's region, the block regions (the first two) and the
  last (which also runs the final norm and output projection). A block region's graph buckets its collectives
  as its first block's attention norm + q / k / v projections (handed to it: nothing moves), its wo, its
  feed-forward, the second block but its w2, and that w2 with the next region's first bucket (the hand-off: the
  next region computes with those weights instead of gathering them) or, in the last region, with the norm +
  output. The embedding's region gathers the embedding and the first region's hand-off. Forward: one all-gather
  per bucket, each in a block region issued while the bucket before it computes. Backward: the same all-gathers
  again (reshard after forward; not the embedding nor a hand-off), one reduce-scatter per bucket, each in a block
  region overlapped, the wo one behind the attention's backward. Inductor's generated code keeps that overlap
  (compute kernels between a collective's start and its wait): the order our pass pins with control
  dependencies (``comm_plan.overlap_order``).
* Replicate over the 2 ranks, compiled regionally, matches too (the hand-off then carries the all-reduce of
  those gradients). Tensor parallel with data parallel compiled regionally: tests/test_tensor_parallel.py
  (dp2 x tp2, 4 ranks).
* An Interleaved1F1B pipeline (2 stages per rank, of 2 and 1 blocks) compiled regionally: both stages of a rank
  share the first stage's compile and comm plan (one graph per region shape), and the losses match the
  reference.

Asserted: losses within 1e-5 and gradient norms within 1e-4 (relative) of the reference over the 10 steps.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests import parity
from tests.distributed_utils import run_worlds_side_by_side
from tests.inductor_code import overlap_in_generated_code
from tests.parity import COMPILED_RTOL, SHARDED_NORM_RTOL, build_layout, max_rel_diff, train_steps
from tests.test_pipeline import RECIPE as PIPELINE_RECIPE
from tests.test_pipeline import assert_parity, job_config
from titan_simple.compile.regions import EMBEDDING, HANDOFF, bucket_modules, region_bucket_plan, regions_of
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError

# test_pipeline's recipe with the debug model's 6 blocks: 3 regions of 2, so that a middle region sits between the
# first and the last (the parity files train fewer blocks).
RECIPE = dataclasses.replace(PIPELINE_RECIPE, extra=())
REGIONAL = ("--compile.enable", "--compile.regional")
CONFIGS = {
    "fully_shard": ("--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=4", *REGIONAL),
    "replicate": ("--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2",
                  "--training.local_batch_size=4", *REGIONAL),
    # Each rank its own stages, so its own class under compile once: nothing to share. Off, so that the codes this
    # rank compiles are all its own (with the caches on, one could come from an earlier job's entry, unrecorded).
    "interleaved_pp2": ("--parallelism.data_parallel_shard_degree=1", "--parallelism.pipeline_parallel_degree=2",
                        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                        "--parallelism.pipeline_parallel_microbatch_size=2", "--training.local_batch_size=8",
                        "--compile.compile_on_one_rank=false", *REGIONAL),
}


def _train_into(out: dict, layout) -> None:
    out.update(train_steps(layout, RECIPE))


def _train(rank: int, world_size: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        layout = build_layout(job_config(*CONFIGS[name]), world_size)
        trained: dict = {}
        # Inductor's generated code of every graph compiled while training (tests/inductor_code.py).
        generated = overlap_in_generated_code(functools.partial(_train_into, trained, layout))
        out = {**trained, "generated_overlap": generated}
        out["mode"] = layout.plan.compile.mode
        forward = regions_of(layout.parts.modules[-1])  # regions.RegionalForward
        out["handoff"] = [bool(r) for r in forward.receivers]
        out["received_bytes"] = [sum(4 * p.numel() for m in received for p in m.parameters())
                                 for received in forward.receivers]
        # Nothing keeps a handed-off weight after its region ran (it would live through the optimizer step).
        out["held_after_training"] = sum(getattr(m, "_held_unsharded", None) is not None
                                         for part in layout.parts.modules for m in part.modules())
        out["bucket_bytes"] = [_bucket_bytes(region, received)
                               for region, received in zip(forward.regions, forward.receivers, strict=True)]
        out["recorders"] = [{"settings": r.settings, "graphs": r.graphs}
                            for r in layout.parts.comm_plan_recorders]
        results[name] = out
    return results


def _bucket_bytes(region, received) -> list[tuple[int, int, int]]:
    """(forward all-gather, backward re-gather, reduce-scatter) bytes (fp32) of each bucket of ``region``'s plan,
    from its modules: the modules it was handed (``received``) move nothing; the embedding and the next region's
    hand-off are not gathered again in backward."""
    rows = []
    for names in region_bucket_plan(2):
        moved = regathered = 0
        for name in names:
            (module,) = bucket_modules(region, [name]) or (None,)
            if module is None or any(module is m for m in received):
                continue
            nbytes = sum(4 * p.numel() for p in module.parameters())
            moved += nbytes
            regathered += 0 if name in (EMBEDDING, HANDOFF) else nbytes
        rows.append((moved, regathered, moved))
    return rows


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every rank's results; the data-parallel configs and the pipeline in two worlds side by side (under compile
    once a data-parallel follower waits for its leader's compile; the pipeline's ranks each compile their own)."""
    parts = run_worlds_side_by_side([(_train, 2, (["fully_shard", "replicate"],)), (_train, 2, (["interleaved_pp2"],))])
    return [{**data_parallel, **pipeline} for data_parallel, pipeline in zip(*parts, strict=True)]


@pytest.fixture(scope="module")
def reference() -> dict:
    return parity.train_reference(RECIPE)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_regional_compile_matches_single_process(ranks, reference, name):
    assert ranks[0][name]["mode"] == "regional"
    run = ranks[0][name]
    losses, norms = max_rel_diff(run["losses"], reference["losses"]), max_rel_diff(run["norms"], reference["norms"])
    print(f"{name}: largest relative difference from the reference: losses {losses:.1e}, norms {norms:.1e}")
    assert_parity(ranks, name, reference, COMPILED_RTOL, norm_rtol=SHARDED_NORM_RTOL)
    # The hand-off runs with data parallel (replicate: it carries the all-reduce of those gradients), not across
    # pipeline stages.
    handoff = {"fully_shard": [False, True, True, True], "replicate": [False, True, True, True],
               "interleaved_pp2": None}[name]
    if handoff is not None:
        assert run["handoff"] == handoff and run["held_after_training"] == 0


@pytest.mark.slow
def test_every_region_runs_one_compiled_code_that_overlaps_its_collectives(ranks):
    result = ranks[0]["fully_shard"]
    assert result["graph_breaks"] == {}
    assert result["unique_graphs"] == 3  # the embedding's region, the block regions, the last one
    # The embedding's region hands the first block region its first weights, and so on.
    assert result["handoff"] == [False, True, True, True] and result["held_after_training"] == 0
    (recorder,) = result["recorders"]
    assert recorder["settings"]["plan"] == region_bucket_plan(2)
    graphs = recorder["graphs"]
    assert sorted(graphs) == ["backward", "backward_1", "backward_2", "forward", "forward_1", "forward_2"]
    # Per region, per bucket: (all-gather, re-gather, reduce-scatter) bytes. The embedding's region moves the
    # embedding and the first block region's first bucket; every block region was handed its first bucket and
    # gathers the next one's with its w2, the last region the norm and output.
    embedding, first, middle, last = result["bucket_bytes"]
    assert first == middle, result["bucket_bytes"]  # one code
    assert embedding[0][0] and embedding[-1][0] and not any(map(any, embedding[1:-1])) and embedding[-1][1] == 0
    # What a region gathers for the next is what the next was handed (the first block's norm and q / k / v).
    handed = result["received_bytes"]
    assert handed[0] == 0 and handed[1] == handed[2] == handed[3] > 0
    assert embedding[-1][0] == handed[1] and first[-1][0] - first[-1][1] == handed[2]
    assert first[0] == last[0] == (0, 0, 0) and all(all(row) for row in first[1:]), result["bucket_bytes"]
    assert first[1:4] == last[1:4] and first[-1][0] > first[-1][1]
    assert last[-1][0] == last[-1][1] > first[-1][1]
    codes = {"embedding": embedding, "blocks": first, "last": last}

    def plan(rows, phase):
        """The collectives a region's graph should issue: forward, one all-gather per moving bucket, in order;
        backward (sorted here; the order is checked below), the re-gathers and the reduce-scatters."""
        if phase == "forward":
            return [("all_gather", row[0]) for row in rows if row[0]]
        return sorted([("all_gather", row[1]) for row in rows if row[1]] +
                      [("reduce_scatter", row[2]) for row in rows if row[2]])

    by_code = {}
    for name, collectives in graphs.items():
        phase = name.split("_")[0]
        found = [(c["kind"], c["bytes"]) for c in collectives]
        key = found if phase == "forward" else sorted(found)
        matches = [code for code, rows in codes.items() if plan(rows, phase) == key]
        assert len(matches) == 1, (name, collectives, result["bucket_bytes"])
        by_code[(phase, matches[0])] = collectives
    assert len(by_code) == 6
    # The embedding's region has nothing to hide its collectives behind but the embedding lookup and its
    # backward; the whole-model graph cannot hide the embedding's either.
    assert all(c["exposed"] for c in by_code[("forward", "embedding")] + by_code[("backward", "embedding")])
    for code in ("blocks", "last"):
        rows, forward, backward = codes[code], by_code[("forward", code)], by_code[("backward", code)]
        # Forward: every all-gather is issued while the bucket before it computes (the wo bucket's while the
        # handed q / k / v projections do).
        assert not any(c["exposed"] for c in forward), (code, forward)
        gathers = [c["bytes"] for c in backward if c["kind"] == "all_gather"]
        reduce_scatters = [c for c in backward if c["kind"] == "reduce_scatter"]
        assert gathers == [row[1] for row in rows[::-1] if row[1]] and backward[0]["kind"] == "all_gather"
        assert [c["bytes"] for c in reduce_scatters] == [row[2] for row in rows[::-1] if row[2]]
        # Every reduce-scatter runs behind compute, the last (wo's) behind the attention's and q / k / v's
        # backward.
        assert not any(c["exposed"] for c in reduce_scatters), (code, backward)
    # The code Inductor generated: 6 graphs, forward and backward of each code. In the block regions every
    # collective but the first backward re-gather has compute kernels between its start and its wait (measured:
    # forward [4, 1, 7, 14] twice; backward [1, 3, 24, 23, 11, 11, 12, 10] and [1, 8, 24, 23, 11, 11, 12, 10];
    # the embedding's region [0, 1] and [0, 0]). Without our control dependencies Inductor waited for every
    # all-gather of a block before its compute, and for the wo reduce-scatter where it was issued.
    gaps = result["generated_overlap"]
    assert len(gaps) == 6, gaps
    forwards = [g for g in gaps if len(g) == 4]
    backwards = [g for g in gaps if len(g) == 8]
    assert len(forwards) == len(backwards) == 2, gaps
    assert all(min(g) > 0 for g in forwards) and all(min(g[1:]) > 0 for g in backwards), gaps


def test_a_region_buckets_its_first_and_last_blocks_finely():
    # The embedding's region finds its embedding in the first bucket and its hand-off in the last.
    handed = ["blocks.0.attention_norm", "blocks.0.attention.wq", "blocks.0.attention.wk", "blocks.0.attention.wv"]
    assert region_bucket_plan(1) == [
        ["tok_embeddings", *handed], ["blocks.0.attention.wo"],
        ["blocks.0.ffn_norm", "blocks.0.feed_forward.w1", "blocks.0.feed_forward.w3"],
        ["blocks.0.feed_forward.w2", "norm", "output", "handoff"]]
    three = region_bucket_plan(3)
    assert three[:3] == [["tok_embeddings", *handed], ["blocks.0.attention.wo"],
                         ["blocks.0.ffn_norm", "blocks.0.feed_forward"]]
    assert three[3:] == [["blocks.1"], ["blocks.2.attention_norm", "blocks.2.attention", "blocks.2.ffn_norm",
                                         "blocks.2.feed_forward.w1", "blocks.2.feed_forward.w3"],
                         ["blocks.2.feed_forward.w2", "norm", "output", "handoff"]]


@pytest.mark.slow
def test_pipeline_stages_of_a_rank_share_one_regional_compile(ranks):
    for rank in ranks:
        recorders = rank["interleaved_pp2"]["recorders"]
        assert len(recorders) == 1
        # A rank runs the stages (0, 1) + (4,) or (2, 3) + (5,): a region of 2 blocks and a shorter one of 1,
        # two codes of the one shared compile; rank 0's first stage also has the embedding's region.
        codes = 3 if rank is ranks[0] else 2
        assert sorted(recorders[0]["graphs"]) == sorted(
            [f"{phase}{f'_{i}' if i else ''}" for phase in ("forward", "backward") for i in range(codes)])


def test_regional_refuses_a_manual_bucket_plan():
    with pytest.raises(ConfigError, match="manual_bucketed_modules.*regional = true"):
        load_job_config(["--compile.enable", "--compile.regional", "--compile.manual_bucketed_modules", '["layers.0"]'])
