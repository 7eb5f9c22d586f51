"""Async tensor parallel: Inductor's micro-pipelined TP pass, switched on per compile.

Its fused kernels run on symmetric memory over NCCL, so no CPU can run them; what a CPU can check is (1) the
plan: the switch reaches every compile of the run and is refused, in one line, where it cannot work; (2) what
the pass would fuse: on CPU the pass finds its patterns and then fuses nothing (it needs NCCL), so we count, in
the compiled forward and backward graphs of a tensor-parallel debug model, the all-gathers feeding matmuls and
the matmul-fed reduce-scatters by the pass's own pattern finders, and check that the dry run, which prices
async TP, finds exactly those in its eager trace.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed_utils import run_on_ranks
from tests.harness import DEBUG, train_py
from tests.parity import Recipe, build_layout, train_steps
from titan_simple.compile.inductor_private import async_tensor_parallel_options, rank_local_compile_options
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError

TP2 = ("--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1")


def _config(*overrides: str):
    return load_job_config(["--config", "llama3_debug.toml", *overrides])


def test_plan_switches_async_tp_on_for_every_compile_of_a_gpu_run():
    run = resolve_plan(_config(*TP2, "--compile.enable", "--parallelism.enable_async_tensor_parallel"), 2, "cuda")
    assert run.compile.async_tensor_parallel
    assert async_tensor_parallel_options() == {"_micro_pipeline_tp": True}
    assert run.compile.inductor_options() == {**rank_local_compile_options(), "_micro_pipeline_tp": True}
    assert any(line.startswith("  compile:") and line.endswith(", async TP") for line in run.describe())
    off = resolve_plan(_config(*TP2, "--compile.enable"), 2, "cuda")
    assert not off.compile.async_tensor_parallel and off.compile.inductor_options() == rank_local_compile_options()


@pytest.mark.parametrize(("overrides", "device", "missing"), [
    ((*TP2, "--compile.enable"), "cpu", r"needs NVIDIA GPUs \(this run is on cpu\); set it to false"),
    (("--compile.enable",), "cuda", "needs tensor_parallel_degree > 1;"),
    (TP2, "cuda", r"needs \[compile\] enable = true with backend = 'inductor';"),
    ((*TP2, "--compile.enable", "--compile.backend=aot_eager"), "cuda", "backend = 'inductor'"),
])
def test_async_tp_where_it_cannot_work_is_one_error_line(overrides, device, missing):
    with pytest.raises(ConfigError, match=missing) as error:
        resolve_plan(_config(*overrides, "--parallelism.enable_async_tensor_parallel"), 2, device)
    assert "\n" not in str(error.value) and "enable_async_tensor_parallel" in str(error.value)


def _compiled_graph_matches(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Compile the TP debug model with the async-TP pass on; per graph Inductor compiles (forward, backward),
    what the pass's pattern finders match."""
    import torch._inductor.fx_passes.post_grad as post_grad

    from titan_simple.compile.compile_plan import CompilePlan
    from titan_simple.compile.inductor_private import async_tensor_parallel_matches

    # The pass the Inductor switch runs (post_grad.py: `if config._micro_pipeline_tp: micro_pipeline_tp_pass`).
    assert callable(getattr(post_grad, "micro_pipeline_tp_pass", None)), "torch moved the async-TP pass"
    matches: list[tuple[int, int]] = []
    original = post_grad.micro_pipeline_tp_pass

    def counting_pass(graph):
        matches.append(async_tensor_parallel_matches(graph))
        return original(graph)

    post_grad.micro_pipeline_tp_pass = counting_pass
    # The plan refuses async TP on CPU (nothing would be fused); the compile's switch is what is tested here.
    CompilePlan.inductor_options = lambda self: async_tensor_parallel_options()
    recipe = Recipe(global_batch=2, steps=1, extra=BLOCKS)
    train_steps(build_layout(recipe.config(*TP2, "--compile.enable"), world_size), recipe)
    return matches


BLOCKS = ("--model.n_layers=2",)  # each block fuses the same collectives; fewer blocks, less to compile


@pytest.mark.slow
def test_dry_run_prices_exactly_the_collectives_inductor_would_fuse(tmp_path):
    compiled = run_on_ranks(_compiled_graph_matches, world_size=2)[0]
    # Forward: every all-gather (2 blocks x attention + feed-forward, and the output projection) and every
    # reduce-scatter but the embedding's; backward: the gradient all-gathers but one, and one reduce-scatter
    # (the others reduce sums of matmuls: the column-parallel layers' input gradients).
    assert compiled == [(5, 4), (4, 1)]

    folder = tmp_path / "dump"
    proc = train_py(*DEBUG, "--dry_run", "--dry_run.world_size", "2", "--dry_run.device", "h100", "--job.dump_folder",
                    folder, *TP2, "--compile.enable", "--parallelism.enable_async_tensor_parallel",
                    "--training.mixed_precision_param=float32", *BLOCKS)
    report = json.loads((folder / "dry_run.json").read_text())
    fused = report["async_tensor_parallel"]["fused"]
    traced = [(fused.get(f"{phase} all_gather", 0), fused.get(f"{phase} reduce_scatter", 0))
              for phase in ("forward", "backward")]
    assert traced == compiled
    times = report["time_seconds"]
    assert times["tensor_parallel_and_other_comm_exposed"] < times["tensor_parallel_and_other_comm"]
    assert "async TP fuses 14 per microbatch pass" in proc.stdout


def _tp_group_registered_for_symmetric_memory(rank: int, world_size: int) -> tuple[bool, bool]:
    import dataclasses

    import torch
    import torch.distributed._symmetric_memory as symmetric_memory

    from titan_simple.models.llama3 import Transformer
    from titan_simple.parallel.parallelize import parallelize_llama

    run = resolve_plan(_config(*TP2, "--training.mixed_precision_param=float32"), world_size, "cpu")
    mesh = run.dims.build_mesh("cpu")
    group = mesh["tp"].get_group().group_name
    before = symmetric_memory.is_symm_mem_enabled_for_group(group)
    # As a GPU run's plan would have it (the plan refuses async TP on CPU).
    parallel = dataclasses.replace(run.parallel,
                                   compile=dataclasses.replace(run.compile, async_tensor_parallel=True))
    with torch.device("meta"):
        model = Transformer(run.model_args)
    parallelize_llama(model, mesh, parallel)
    return before, symmetric_memory.is_symm_mem_enabled_for_group(group)


def test_async_tp_registers_the_tensor_parallel_group_for_symmetric_memory():
    """The pass fuses only on groups registered for symmetric memory (torch 2.13 checks its registry although it
    calls the registration deprecated): the recipe registers the TP group, silently."""
    from tests.distributed_utils import run_on_ranks

    assert run_on_ranks(_tp_group_registered_for_symmetric_memory, world_size=2) == [(False, True)] * 2
