"""Every documented activation checkpointing setting trains compiled, in every compile mode, with SimpleFSDP
(issue 30: full AC and every-N-th-block AC failed at the first compiled step, while the suite was green).

One 2-process job (dp_shard2, fp32, the debug model cut to 2 blocks, 2 steps) trains each cell of the matrix
``AC_SETTINGS`` x ``COMPILE_MODES`` through the trainer's own build and step; each must give the single-process
reference's losses and gradient norms (recomputing changes no number). The compile modes are SimpleFSDP's three:
the whole step as one graph (``whole_with_loss``; ``whole`` without the loss is the tensor- and pipeline-parallel
form, trained by tests/test_shipped_configs.py), regional compilation, and one graph per block (what the
zero-bubble pipeline schedules use; forced here through the plan, so it runs on SimpleFSDP without a pipeline).
Cells with recomputation compile with Inductor (its min-cut partitioner is where the RNG-state bug struck); the
cells without (no AC, the op-level policies that save attention) compile with ``aot_eager``, the same AOTAutograd
tracing and checkpoint tagging at a fraction of the compile time: Inductor runs them in tests/test_compile.py,
tests/test_regional_compile.py and the 8B config's run.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed_utils import run_worlds_side_by_side
from tests.parity import COMPILED_RTOL, SHARDED_NORM_RTOL, Recipe, build_layout, max_rel_diff, train_steps
from titan_simple.config import ActivationCheckpoint
from titan_simple.parallel.activation_checkpoint import SELECTIVE_OP_POLICIES

RECIPE = Recipe(global_batch=4, seq_len=32, steps=2, extra=("--model.n_layers=2",))
AC_SETTINGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "full": ("--activation_checkpoint.mode=full",),
    **{f"selective {option}": ("--activation_checkpoint.mode=selective",
                               f"--activation_checkpoint.selective_ac_option={option}")
       for option in (*SELECTIVE_OP_POLICIES, "2")},  # "2": every second block fully checkpointed
}
RECOMPUTES_ATTENTION = {"full", "selective 2"}  # Inductor for these (INDUCTOR_CELLS), aot_eager for the others
COMPILE_MODES: dict[str, tuple[str, ...]] = {
    "whole": (),
    "regional": ("--compile.regional", "--compile.regional_blocks=1"),
    "per_block": (),  # forced through the plan (_forced_mode)
}


def _forced_mode(name: str):
    """The plan's compile-mode choice, with ``per_block`` forced for that column."""
    from titan_simple.core import plan

    choose = plan.choose_compile_mode
    return (lambda config, dims, reasons=None: "per_block") if name == "per_block" else choose


def _train_matrix(rank: int, world_size: int, cells: dict[str, tuple[str, str, tuple[str, ...]]]) -> dict:
    from titan_simple.core import plan

    choose, out = plan.choose_compile_mode, {}
    for name, (mode, backend, overrides) in cells.items():
        plan.choose_compile_mode = _forced_mode(mode)
        try:
            config = RECIPE.config("--training.local_batch_size=2", "--compile.enable", f"--compile.backend={backend}",
                                   *overrides)
            layout = build_layout(config, world_size)
            out[name] = {**train_steps(layout, RECIPE), "mode": layout.plan.compile.mode}
        finally:
            plan.choose_compile_mode = choose
    return out


# With 2 blocks, "selective 2" checkpoints block 1 alone: its per-block and one-block-per-region graphs are the
# "full" cells' and a plain block's, which Inductor compiles there; Inductor compiles its whole-step graph.
INDUCTOR_CELLS = {f"{ac}/{mode}" for ac in RECOMPUTES_ATTENTION for mode in COMPILE_MODES} - {
    "selective 2/per_block", "selective 2/regional"}
CELLS = {f"{ac}/{mode}": (mode, "inductor" if f"{ac}/{mode}" in INDUCTOR_CELLS else "aot_eager",
                          (*ac_args, *mode_args))
         for ac, ac_args in AC_SETTINGS.items() for mode, mode_args in COMPILE_MODES.items()}


@pytest.fixture(scope="module")
def matrix() -> dict:
    """The cells in two 2-process worlds side by side, every other cell each (two Inductor cells each): a world's
    follower rank waits while its leader compiles (compile once), the other world's compile uses that core."""
    names = list(CELLS)
    halves = [{name: CELLS[name] for name in names[start::2]} for start in (0, 1)]
    first, second = run_worlds_side_by_side([(_train_matrix, 2, (half,)) for half in halves])
    return {**first[0], **second[0]}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_steps(build_layout(RECIPE.config(f"--training.local_batch_size={RECIPE.global_batch}")), RECIPE)


def test_the_matrix_covers_every_documented_setting():
    """Every mode of the config and every op-level option; a new one must join the matrix."""
    modes = next(f for f in dataclasses.fields(ActivationCheckpoint) if f.name == "mode").metadata["choices"]
    assert {args[0].split("=")[1] for args in AC_SETTINGS.values() if args} | {"none"} == set(modes)
    assert {name.split()[1] for name in AC_SETTINGS if name.startswith("selective ")} > set(SELECTIVE_OP_POLICIES)


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(CELLS))
def test_activation_checkpointing_trains_compiled_like_one_process(matrix, reference, cell):
    run = matrix[cell]
    mode = cell.split("/")[1]
    assert run["mode"] == ("whole_with_loss" if mode == "whole" else mode)
    assert max_rel_diff(run["losses"], reference["losses"]) <= COMPILED_RTOL, (run["losses"], reference["losses"])
    assert max_rel_diff(run["norms"], reference["norms"]) <= SHARDED_NORM_RTOL, (run["norms"], reference["norms"])
    assert run["graph_breaks"] == {}
