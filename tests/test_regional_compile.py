"""Regional compilation (``[compile] regional``, issue 21): one compiled code for every region of blocks.

One set of 2 gloo processes trains test_pipeline's recipe (6-layer debug model, fp32, 10 AdamW steps with
clipping active) through the trainer's own build and step, with the default 2 blocks per region:

* SimpleFSDP fully_shard over 2 ranks, compiled regionally, matches the single-process reference (losses and
  gradient norms). Dynamo compiles 3 frames: one for the first 2 regions, one for the last (which also runs the
  final norm and output projection) and the embedding. Each region graph buckets its collectives as the first
  block's attention norm + wq, the rest of its attention, its feed-forward, the second block but its w2, that
  w2 (in the last region with the norm + output): one all-gather per bucket in forward, each but the first
  overlapping the compute before it; in backward the same all-gathers again (reshard after forward) and one
  reduce-scatter per bucket, all but the region's last overlapped. Inductor's generated code keeps that
  overlap in both graphs (compute kernels between a collective's start and its wait): the order our pass pins
  with control dependencies (``comm_plan.overlap_order``).
* Tensor parallel over the 2 ranks (sequence parallel, loss parallel), compiled regionally, matches too.
* An Interleaved1F1B pipeline (2 stages per rank, of 2 and 1 blocks) compiled regionally: both stages of a rank
  share the first stage's compile and comm plan (one graph per region shape), and the losses match the
  reference.

Measured (2 CPU cores, torch 2.13), largest relative difference from the reference over the 10 steps: losses
1.2e-7 (fully_shard, tp2) and 0 (pipeline), gradient norms 3.1e-5 (fully_shard, tp2) and 1.6e-7 (pipeline);
asserted 1e-5 and 1e-4. About 50 s for the job.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed_utils import run_on_ranks_retrying_aborts
from tests.inductor_code import overlap_in_generated_code
from tests.parity import COMPILED_RTOL, SHARDED_NORM_RTOL, build_layout, max_rel_diff, train_steps
from tests.test_pipeline import RECIPE, assert_parity, job_config, train_reference
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError
from titan_simple.parallel.compile import bucket_modules, comm_plan_recorders, region_bucket_plan

REGIONAL = ("--compile.enable", "--compile.regional")
CONFIGS = {
    "fully_shard": ("--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=4", *REGIONAL),
    "tp2": ("--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2",
            "--training.local_batch_size=8", *REGIONAL),
    "interleaved_pp2": ("--parallelism.data_parallel_shard_degree=1", "--parallelism.pipeline_parallel_degree=2",
                        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                        "--parallelism.pipeline_parallel_microbatch_size=2", "--training.local_batch_size=8",
                        *REGIONAL),
}


def _train_into(out: dict, layout) -> None:
    out.update(train_steps(layout, RECIPE))


def _train(rank: int, world_size: int) -> dict:
    results = {}
    for name, overrides in CONFIGS.items():
        layout = build_layout(job_config(*overrides), world_size)
        trained: dict = {}
        # Inductor's generated code of every graph compiled while training (tests/inductor_code.py).
        generated = overlap_in_generated_code(functools.partial(_train_into, trained, layout))
        out = {**trained, "generated_overlap": generated}
        out["mode"] = layout.plan.compile.mode
        # The bytes of each bucket (fp32, gathered) of the first region and of the last, which runs the final
        # norm and output too.
        regions = layout.parts.modules[-1].block_regions
        out["bucket_bytes"] = [
            [sum(4 * p.numel() for m in bucket_modules(region, names) for p in m.parameters())
             for names in region_bucket_plan(2)] for region in (regions[0], regions[-1])]
        out["recorders"] = [{"settings": r.settings, "graphs": r.graphs}
                            for r in comm_plan_recorders(layout.parts.modules)]
        results[name] = out
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks_retrying_aborts(_train, 2)  # compiled cases


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_regional_compile_matches_single_process(ranks, reference, name):
    assert ranks[0][name]["mode"] == "regional"
    run = ranks[0][name]
    losses, norms = max_rel_diff(run["losses"], reference["losses"]), max_rel_diff(run["norms"], reference["norms"])
    print(f"{name}: largest relative difference from the reference: losses {losses:.1e}, norms {norms:.1e}")
    assert_parity(ranks, name, reference, COMPILED_RTOL, norm_rtol=SHARDED_NORM_RTOL)


@pytest.mark.slow
def test_every_region_runs_one_compiled_code_that_overlaps_its_collectives(ranks):
    result = ranks[0]["fully_shard"]
    assert result["graph_breaks"] == {}
    assert result["unique_graphs"] == 3  # the regions, the last region (with the norm and output), tok_embeddings
    (recorder,) = result["recorders"]
    assert recorder["settings"]["plan"] == region_bucket_plan(2)
    graphs = recorder["graphs"]
    # The first two regions share "forward"; the last one compiled its own ("forward_1"), and its backward ran
    # first ("backward").
    assert sorted(graphs) == ["backward", "backward_1", "forward", "forward_1"]
    # The first block's norm + wq, wk..wo, feed-forward; the second block but its w2; its w2 (and in the last
    # region the norm and output with it).
    region, last_region = result["bucket_bytes"]
    assert len(region) == 5 and all(region) and region[:-1] == last_region[:-1], result["bucket_bytes"]
    assert last_region[-1] > region[-1]
    for name, sizes in (("forward", region), ("forward_1", last_region), ("backward_1", region),
                        ("backward", last_region)):
        collectives = graphs[name]
        gathers = [c for c in collectives if c["kind"] == "all_gather"]
        reduce_scatters = [c for c in collectives if c["kind"] == "reduce_scatter"]
        if name.startswith("forward"):
            # One all-gather per bucket, in order; each but the first issued while the bucket before it computes.
            assert [(c["kind"], c["bytes"]) for c in collectives] == [("all_gather", b) for b in sizes], (name, gathers)
            assert [c["exposed"] for c in gathers] == [True] + [False] * (len(sizes) - 1), (name, gathers)
            continue
        # Buckets in reverse: the same all-gathers again, the first the last bucket's (the smallest tail: w2, or
        # w2 with the norm + output); every reduce-scatter but the region's last (the first block's norm + wq)
        # runs while the bucket before it computes its gradients.
        assert [c["bytes"] for c in gathers] == sizes[::-1] and collectives[0] is gathers[0], (name, collectives)
        assert [c["bytes"] for c in reduce_scatters] == sizes[::-1], (name, reduce_scatters)
        assert [c["exposed"] for c in reduce_scatters] == [False] * (len(sizes) - 1) + [True], (name, collectives)
    # The code Inductor generated: 6 graphs (the two region codes and the embedding, forward and backward
    # each). In a region's forward every all-gather but the first has compute kernels between its start and
    # its wait; in its backward all but the first re-gather and the last reduce-scatter (measured [0, 2, 7, 7,
    # 14] and [1, 3, 24, 23, 11, 11, 11, 12, 5, 0], the first re-gather with 1 kernel). Without our control
    # dependencies Inductor waited for every all-gather of a block before its compute.
    gaps = result["generated_overlap"]
    assert len(gaps) == 6, gaps
    region_forwards = [g for g in gaps if len(g) == 5]
    region_backwards = [g for g in gaps if len(g) == 10]
    assert len(region_forwards) == len(region_backwards) == 2, gaps
    for forward in region_forwards:
        assert forward[0] == 0 and min(forward[1:]) > 0, gaps
    for backward in region_backwards:
        assert sum(n > 0 for n in backward[1:-1]) == len(backward) - 2, gaps


def test_a_region_buckets_its_first_and_last_blocks_finely():
    assert region_bucket_plan(1) == [
        ["blocks.0.attention_norm", "blocks.0.attention.wq"],
        ["blocks.0.attention.wk", "blocks.0.attention.wv", "blocks.0.attention.wo"],
        ["blocks.0.ffn_norm", "blocks.0.feed_forward.w1", "blocks.0.feed_forward.w3"],
        ["blocks.0.feed_forward.w2", "norm", "output"]]
    three = region_bucket_plan(3)
    assert three[:3] == [["blocks.0.attention_norm", "blocks.0.attention.wq"],
                         ["blocks.0.attention.wk", "blocks.0.attention.wv", "blocks.0.attention.wo"],
                         ["blocks.0.ffn_norm", "blocks.0.feed_forward"]]
    assert three[3:] == [["blocks.1"], ["blocks.2.attention_norm", "blocks.2.attention", "blocks.2.ffn_norm",
                                         "blocks.2.feed_forward.w1", "blocks.2.feed_forward.w3"],
                         ["blocks.2.feed_forward.w2", "norm", "output"]]


@pytest.mark.slow
def test_pipeline_stages_of_a_rank_share_one_regional_compile(ranks):
    for rank in ranks:
        recorders = rank["interleaved_pp2"]["recorders"]
        assert len(recorders) == 1
        # A rank runs the stages (0, 1) + (4,) or (2, 3) + (5,): a region of 2 blocks and a shorter one of 1,
        # two graphs of the one shared compile.
        assert sorted(recorders[0]["graphs"]) == ["backward", "backward_1", "forward", "forward_1"]


def test_regional_refuses_a_manual_bucket_plan():
    with pytest.raises(ConfigError, match="manual_bucketed_modules.*regional = true"):
        load_job_config(["--compile.enable", "--compile.regional", "--compile.manual_bucketed_modules", '["layers.0"]'])
