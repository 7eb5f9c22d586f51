"""Reproduce torch 2.13's failure to compile whole pipeline stages with tensor parallel inside when a pp rank
runs two stages (Interleaved1F1B), the reason ``train/plan.choose_compile_mode`` compiles such stages block by
block (docs/parallelism.md).

    python scripts/repro_tp_pp_whole_stage_compile.py                       # Interleaved1F1B: fails
    python scripts/repro_tp_pp_whole_stage_compile.py --schedule 1F1B       # one stage per rank: trains

Four gloo processes (tp2 x pp2) build the debug model through the trainer's own build with the per-block rule
switched off, and run one training step. Prints ``ok`` and the loss, or the compiler's error (torch 2.13:
"AssertionError: Node tangents_2 was invalid, but is output" from AOTAutograd's min-cut partitioner while the
schedule infers the shapes of a middle stage; with ``--disable-loss-parallel`` instead "device_mesh._get_submesh
is not an OpOverload" from Inductor).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def one_step(rank: int, world_size: int, schedule: str, loss_parallel: bool) -> str:
    from tests.parity import Recipe, build_layout
    from titan_simple.train import plan

    # The plan's rule compiles such stages block by block; take it out: every stage compiles whole.
    plan.choose_compile_mode = lambda config, dims, reasons=None: "whole"
    recipe = Recipe(global_batch=8)
    overrides = ["--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2",
                 f"--parallelism.pipeline_parallel_schedule={schedule}", "--training.local_batch_size=8",
                 "--compile.enable"]
    if not loss_parallel:
        overrides.append("--parallelism.disable_loss_parallel")
    layout = build_layout(recipe.config(*overrides), world_size)
    inputs, labels = recipe.batch(0)
    result = layout.step([(inputs, labels)])  # a failing rank must exit: its peers then stop waiting on it
    return f"ok, loss sum {result.loss_sum.item():.4f}"


def main() -> None:
    from tests.distributed_utils import RankFailed, run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="Interleaved1F1B", choices=("Interleaved1F1B", "1F1B"))
    parser.add_argument("--disable-loss-parallel", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, tp2 x pp2, {args.schedule}, whole-stage compile")
    try:
        results = run_on_ranks(one_step, 4, args=(args.schedule, not args.disable_loss_parallel))
    except RankFailed as failure:  # the compiler's error, and the peers that lost their connection to it
        lines = str(failure).splitlines()
        print("\n".join(line for line in lines if line.startswith("---") or "Error:" in line))
        sys.exit(1)
    for rank, line in enumerate(results):
        print(f"rank {rank}: {line}")


if __name__ == "__main__":
    main()
