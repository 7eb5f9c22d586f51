"""The 2-D and 3-D layouts that no other test file covers: tensor parallel composed with pipeline parallel, with
data-parallel replication, and all three at once (compiled), each against the same single-process reference.

The recipe is ``tests/test_pipeline.py``'s with 2 blocks (debug model, fp32, 10 AdamW steps with
clipping active, a fixed global batch of 8 x 64 random tokens per step, split along the batch dim over the dp
ranks); the loop is the trainer's own step (``tests/parity.py``), which runs the loss and its backward under
``loss_parallel_context`` when the logits are vocab-sharded.

Measured on 2 CPU cores, torch 2.13 (largest relative difference of the per-step losses from the reference,
where printed): tp2 x pp2 compiled 1.2e-7; dp_replicate2 x tp2 eager 1.2e-7; dp_shard2 x tp2 x pp2
(8 processes) eager 1.2e-7; dp_shard2 x tp2 compiled with transformer_block bucketing + reorder 1.2e-7
(auto bucketing also gave 1.2e-7 here; test_tensor_parallel.py trains transformer_block bucketing on dp2 x tp2
against one process). Asserted: 1e-6 eager, 1e-5 compiled (test_pipeline's tolerances); gradient norms
1e-4 (torch's fp32 CPU norm of the sharded output-projection gradient; see test_tensor_parallel.py).
(Those differences were measured with 6 blocks; with 2 the layouts pass the same tolerances.) Runtime of the
jobs alone: 47 s for the 4-process one, 46 s for the 8-process one (2026-11-26, 2 blocks; 97 / 72 s with 6).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests import parity
from tests.distributed_utils import run_on_ranks
from tests.parity import COMPILED_RTOL, EAGER_RTOL, SHARDED_NORM_RTOL, build_layout, train_steps
from tests.test_pipeline import GLOBAL_BATCH, MAX_NORM, assert_parity, job_config
from tests.test_pipeline import RECIPE as PIPELINE_RECIPE

N_LAYERS = 2  # 1F1B on pp2: a block per stage
RECIPE = dataclasses.replace(PIPELINE_RECIPE, extra=(f"--model.n_layers={N_LAYERS}",))


def train_layout(config, world_size: int) -> dict:
    """``STEPS`` steps of the trainer's own build and step under any layout; every rank returns the global
    losses and norms."""
    return train_steps(build_layout(config, world_size), RECIPE)


def _run_configs(rank: int, world_size: int, configs: dict[str, tuple[str, ...]]) -> dict:
    return {name: train_layout(job_config(*RECIPE.extra, *args), world_size) for name, args in configs.items()}


def _layout(dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1, *extra: str) -> tuple[str, ...]:
    dp = dp_replicate * dp_shard
    args = [f"--parallelism.data_parallel_replicate_degree={dp_replicate}",
            f"--parallelism.data_parallel_shard_degree={dp_shard}",
            f"--parallelism.tensor_parallel_degree={tp}",
            f"--parallelism.pipeline_parallel_degree={pp}",
            f"--training.local_batch_size={GLOBAL_BATCH // dp}"]
    if pp > 1:
        args += ["--parallelism.pipeline_parallel_schedule=1F1B",
                 f"--parallelism.pipeline_parallel_microbatch_size={max(1, GLOBAL_BATCH // dp // 4)}"]
    return (*args, *extra)


COMPILE = ("--compile.enable",)
# Compiled layouts run first in each job (historical: a pipelined TP model compiled after the same layout ran
# eagerly in the process failed with "Node tangents_2 was invalid, but is output"; the cause was two equal but
# distinct tp DeviceMesh objects, fixed by dims.tensor_parallel_mesh,
# docs/research/repro/repro_tp_pp_whole_stage_compile.py).
# tp2 x pp2 compiled is the 8-process layout's (with dp_shard2) and the 405B config test's (Interleaved1F1B).
FOUR_RANK_CONFIGS = {
    "dp_replicate2_tp2/compiled": _layout(2, 1, 2, 1, *COMPILE),
    "tp2_pp2/eager": _layout(tp=2, pp=2),
    "dp_replicate2_tp2/eager": _layout(dp_replicate=2, tp=2),
}
# The 3-D layout is compiled here; each dimension's eager path is covered by its own file (the eager
# 8-process run cost about 15 s of the suite: 87 -> 72 s). tp2 x pp2 compiled stays in fp32 here (1e-5); the
# 405B config test trains the same layout in bf16 (Interleaved1F1B).
EIGHT_RANK_CONFIGS = {
    "dp_shard2_tp2_pp2/compiled": _layout(1, 2, 2, 2, *COMPILE),
}

# Bucketing and reordering on the 2-D (dp, tp) mesh: test_tensor_parallel.py trains transformer_block
# against one process, and the compiled dp_shard2 x tp2 x pp2 layout here (bucketed by default) too.


@pytest.fixture(scope="module")
def reference() -> dict:
    return parity.train_reference(RECIPE)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_run_configs, 4, args=(FOUR_RANK_CONFIGS,))


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict]:
    return run_on_ranks(_run_configs, 8, args=(EIGHT_RANK_CONFIGS,))


def test_reference_clips(reference):
    """Clipping is active in the reference, so the layouts' pp and tp ranks must agree on the global norm."""
    assert reference["norms"][0] > MAX_NORM


def _rtol(key: str) -> float:
    return COMPILED_RTOL if "compiled" in key else EAGER_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FOUR_RANK_CONFIGS))
def test_four_process_layouts_match_single_process(four_ranks, reference, key):
    assert_parity(four_ranks, key, reference, _rtol(key), norm_rtol=SHARDED_NORM_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(EIGHT_RANK_CONFIGS))
def test_dp_shard2_tp2_pp2_on_eight_processes_matches_single_process(eight_ranks, reference, key):
    assert_parity(eight_ranks, key, reference, _rtol(key), norm_rtol=SHARDED_NORM_RTOL)

