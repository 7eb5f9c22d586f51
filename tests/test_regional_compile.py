"""Regional compilation (``[compile] regional``, issue 21): one compiled code for every region of blocks.

One set of 2 gloo processes trains test_pipeline's recipe (6-layer debug model, fp32, 10 AdamW steps with
clipping active) through the trainer's own build and step, with the default 2 blocks per region:

* SimpleFSDP fully_shard over 2 ranks, compiled regionally, matches the single-process reference (losses and
  gradient norms). Dynamo compiles 4 frames: one for all 3 regions, and the embedding, final norm and output
  projection. The comm plan has one forward and one backward region graph (a region compiled a second time
  would add ``forward_1``). Each region graph buckets its collectives as the first block's attention half, its
  feed-forward half and the second block: forward 3 all-gathers, the second and third overlapping the compute
  before them (the second block's weights arrive while the first block computes); backward the same 3
  all-gathers again (reshard after forward) and 3 reduce-scatters, all but the region's last overlapped.
  Inductor's generated code keeps that overlap in both graphs (compute kernels between a collective's start
  and its wait): the order our pass pins with control dependencies (``comm_plan.overlap_order``).
* Tensor parallel over the 2 ranks (sequence parallel, loss parallel), compiled regionally, matches too.
* An Interleaved1F1B pipeline (2 stages per rank, of 2 and 1 blocks) compiled regionally: both stages of a rank
  share the first stage's compile and comm plan (one graph per region length), and the losses match the
  reference.

Measured (2 CPU cores, torch 2.13), largest relative difference from the reference over the 10 steps: losses
1.2e-7 (fully_shard, tp2) and 0 (pipeline), gradient norms 3.1e-5 (fully_shard, tp2) and 1.6e-7 (pipeline);
asserted 1e-5 and 1e-4. About 37 s for the job.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed_utils import run_on_ranks
from tests.inductor_code import overlap_in_generated_code
from tests.parity import COMPILED_RTOL, SHARDED_NORM_RTOL, build_layout, max_rel_diff, train_steps
from tests.test_pipeline import RECIPE, assert_parity, job_config, train_reference
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError
from titan_simple.parallel.compile import BLOCK_BUCKETS, comm_plan_recorders, region_bucket_plan

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
        out["recorders"] = [{"settings": r.settings, "graphs": r.graphs}
                            for r in comm_plan_recorders(layout.parts.modules)]
        results[name] = out
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_train, 2)


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
    assert result["unique_graphs"] == 4  # the regions, tok_embeddings, norm, output
    (recorder,) = result["recorders"]
    assert recorder["settings"]["plan"] == region_bucket_plan(2)
    graphs = recorder["graphs"]
    assert sorted(graphs) == ["backward", "forward"]
    forward = graphs["forward"]
    assert [(c["kind"], c["exposed"]) for c in forward] == [("all_gather", True), ("all_gather", False),
                                                            ("all_gather", False)]
    # Across blocks: the second block's all-gather is issued while the first block's feed-forward computes.
    assert any((o["module"] or "").startswith("blocks.0.feed_forward") for o in forward[2]["overlaps"]), forward[2]
    backward = graphs["backward"]
    assert sorted(c["kind"] for c in backward) == ["all_gather"] * 3 + ["reduce_scatter"] * 3
    reduce_scatters = [c for c in backward if c["kind"] == "reduce_scatter"]
    # The second block's, then the first block's feed-forward half, both while compute runs; the region's last,
    # the first block's attention half, has nothing of the region left to hide behind.
    assert [c["exposed"] for c in reduce_scatters] == [False, False, True], reduce_scatters
    assert all(m.startswith("blocks.1.") for m in reduce_scatters[0]["modules"]), reduce_scatters[0]
    assert all(m.startswith("blocks.0.attention") for m in reduce_scatters[2]["modules"]), reduce_scatters[2]
    # The code Inductor generated: 8 graphs (region, embedding, norm, output; forward and backward each). In the
    # region's forward every all-gather but the first has compute kernels between its start and its wait; in
    # its backward every collective but the region's last reduce-scatter (measured [0, 7, 7] and
    # [1, 27, 11, 11, 16, 0], the first re-gather with 1 kernel). Without our control dependencies Inductor
    # waited for every all-gather of a block before its compute: [0, 0] with one block per region.
    gaps = result["generated_overlap"]
    assert len(gaps) == 8, gaps
    (region_forward,) = [g for g in gaps if len(g) == 3]
    (region_backward,) = [g for g in gaps if len(g) == 6]
    assert region_forward[0] == 0 and min(region_forward[1:]) > 0, gaps
    assert sum(n > 0 for n in region_backward) >= 4, gaps


def test_a_region_splits_its_first_block_in_halves():
    halves = [[f"blocks.0.{name}" for name in bucket] for bucket in BLOCK_BUCKETS]
    assert region_bucket_plan(1) == halves
    assert region_bucket_plan(3) == [*halves, ["blocks.1"], ["blocks.2"]]


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
