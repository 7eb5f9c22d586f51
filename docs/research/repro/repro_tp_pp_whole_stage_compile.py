"""Reproduce torch 2.13's failure to compile pipeline stages with tensor parallel inside when the stage's received
activations and its parameters live on equal but distinct ``tp`` mesh objects, and show that titan_simple's one
mesh object per world (``parallel/dims.tensor_parallel_mesh``) makes them compile and train (issue 30).

    python docs/research/repro/repro_tp_pp_whole_stage_compile.py                     # titan_simple as it is: trains
    python docs/research/repro/repro_tp_pp_whole_stage_compile.py --fresh-mesh        # a new tp slice per lookup: fails
    python docs/research/repro/repro_tp_pp_whole_stage_compile.py --schedule 1F1B --fresh-mesh

Four gloo processes (tp2 x pp2) build the debug model through the trainer's own build, every stage compiled whole,
and run one training step. Prints the loss on every rank, or the compiler's error: with ``--fresh-mesh`` the
pipeline's ``get_mesh`` returns ``world["tp"]`` (a new, equal DeviceMesh per call, as before the fix), and
AOTAutograd's partitioner fails while the schedule infers a receiving stage's shapes ("AssertionError: Node
tangents_2 was invalid, but is output"; Interleaved1F1B, where a rank runs two stages). The upstream report text
is in docs/research/upstream_rng_state_after_opaque.md (section 2).
"""

from __future__ import annotations

import argparse
import sys

import torch  # noqa: E402


def one_step(rank: int, world_size: int, schedule: str, loss_parallel: bool, fresh_mesh: bool) -> str:
    from tests.parity import Recipe, build_layout
    from titan_simple.parallel import pipeline

    if fresh_mesh:  # the stages' received activations on a new slice of the world mesh per lookup
        pipeline._named_mesh = lambda mesh, names: mesh[names]
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
    parser.add_argument("--fresh-mesh", action="store_true", help="a new tp mesh object per lookup (fails)")
    args = parser.parse_args()
    mesh = "a fresh tp mesh per lookup" if args.fresh_mesh else "one tp mesh object"
    print(f"torch {torch.__version__}, tp2 x pp2, {args.schedule}, whole-stage compile, {mesh}")
    try:
        results = run_on_ranks(one_step, 4, args=(args.schedule, not args.disable_loss_parallel, args.fresh_mesh))
    except RankFailed as failure:  # the compiler's error, and the peers that lost their connection to it
        lines = str(failure).splitlines()
        print("\n".join(line for line in lines if line.startswith("---") or "Error:" in line))
        sys.exit(1)
    for rank, line in enumerate(results):
        print(f"rank {rank}: {line}")


if __name__ == "__main__":
    main()
