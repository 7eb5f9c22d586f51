"""A compile talks only to its own pipeline stage's process groups (issue 30: the pipeline-parallel deadlock).

Pipeline stages compile lazily, one after another, while the ranks of the other stages wait in a P2P receive; a
collective over the world (or another stage's groups) issued while compiling blocks every rank until the NCCL
timeout. Here 4 gloo ranks (pp2 x dp_shard2, 1F1B, debug model of 2 layers: one per stage) compile and train one
step under every bucketing setting, with the overlap scheduler on the GPU's runtime model
(``analytical_runtime_ms``, the one CUDA runs) and every way a compile could reach another rank watched:

* torch.distributed's collective, object-collective, barrier and group-creation functions (what Inductor,
  AOTAutograd and Dynamo call) are wrapped: one called while compiling on a group other than the stage's own
  data-parallel group fails at once (a real call would deadlock);
* each group's sequence number (every collective, functional collectives and P2P included, advances it) is read
  when a compile starts and ends: the world and the pipeline group must not move.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.distributed_utils import run_on_ranks
from tests.parity import Recipe, build_layout, train_steps

RECIPE = Recipe(seq_len=32, global_batch=4, steps=1, extra=("--model.n_layers=2",))
# Gathering per microbatch puts SimpleFSDP's all-gathers and reduce-scatters into each stage's graphs (gathering
# once per step, the default under pipeline parallel, leaves them outside), so the overlap passes have work.
LAYOUT = ("--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
          "--parallelism.pipeline_parallel_schedule=1F1B", "--training.local_batch_size=2",
          "--parallelism.pipeline_parallel_microbatch_size=1", "--parallelism.fsdp_gather=per_microbatch",
          "--compile.enable")
# The settings without reordering run a subset of these passes (the same Inductor path, fewer of our passes).
SETTINGS = {
    "none+reorder": ("--compile.bucketing=none", "--compile.reorder=true"),
    "transformer_block+reorder": ("--compile.bucketing=transformer_block", "--compile.reorder=true"),
    "auto": ("--compile.bucketing=auto", "--compile.reorder=true"),
}
# The torch.distributed functions compile-time code calls to reach other ranks (object collectives
# for runtime estimates and partitioner decisions, barriers, new groups for autotuning / compiler collectives);
# P2P is left to the sequence numbers (P2POp accepts only the original isend / irecv).
WATCHED = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier",
           "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "broadcast", "new_group", "new_subgroups", "split_group",
           "_new_group_with_tag")


class CompileWatch:
    """Records what this rank sends to which group while Dynamo / AOTAutograd / Inductor compile."""

    def __init__(self) -> None:
        self.depth = 0
        self.own: set[str] = set()  # group names a compile may use: the stage's data-parallel group
        self.foreign: dict[str, dist.ProcessGroup] = {}  # groups it must not: the world, the pipeline group
        self.calls: list[str] = []  # "name(group)" of each watched call made while compiling
        self.moved: list[str] = []  # foreign groups whose sequence number advanced during a compile
        self.compiles = 0
        self._seq: dict[str, int] = {}

    def install(self) -> None:
        for name in WATCHED:
            for module in (dist, c10d):
                original = getattr(module, name, None)
                if original is not None:
                    setattr(module, name, self._wrap(name, original))

        reset = torch._dynamo.reset

        def reset_and_listen() -> None:  # reset() forgets the callbacks (tests/parity.py resets per layout)
            reset()
            self.listen()

        torch._dynamo.reset = reset_and_listen
        self.listen()

    def listen(self) -> None:
        """Hear every compile's start and end: Dynamo's, and AOTAutograd's lazy backward compile."""
        torch._dynamo.callback_handler.register_start_callback(self._start)
        torch._dynamo.callback_handler.register_end_callback(self._end)

    def _wrap(self, name: str, original):
        if getattr(original, "_watched", False):
            return original

        @functools.wraps(original)
        def watched(*args, **kwargs):
            if self.depth:
                group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
                label = "world" if group is None or group is dist.group.WORLD else group.group_name
                self.calls.append(f"{name}({label})")
                if name.startswith(("new_", "split", "_new")) or label not in self.own:
                    raise RuntimeError(f"{name} on group {label} while compiling: would deadlock pipeline stages")
            return original(*args, **kwargs)

        watched._watched = True
        return watched

    @contextlib.contextmanager
    def stage(self, own: list[dist.ProcessGroup], foreign: dict[str, dist.ProcessGroup]) -> Iterator[None]:
        self.own = {g.group_name for g in own}
        self.foreign = foreign
        try:
            yield
        finally:
            self.own, self.foreign = set(), {}

    def _start(self, _args) -> None:
        self.depth += 1
        self.compiles += 1
        self._seq = {name: g._get_sequence_number_for_group() for name, g in self.foreign.items()}

    def _end(self, _args) -> None:
        self.depth -= 1
        for name, group in self.foreign.items():
            if group._get_sequence_number_for_group() != self._seq[name]:
                self.moved.append(name)


def _compile_every_setting(rank: int, world_size: int) -> dict[str, dict]:
    import titan_simple.compile.compiler as compile_module
    from titan_simple.compile.inductor_private import analytical_runtime_ms

    # The GPU's runtime model (no calibration, no NCCL), which the overlap scheduler gets on CUDA.
    compile_module.runtime_estimator = lambda cpu: analytical_runtime_ms
    watch = CompileWatch()
    watch.install()
    results = {}
    for name, overrides in SETTINGS.items():
        torch._dynamo.reset()
        layout = build_layout(RECIPE.config(*LAYOUT, *overrides), world_size)
        own = [layout.mesh["dp_shard"].get_group()]
        foreign = {"world": c10d._get_default_group(), "pp": layout.mesh["pp"].get_group()}
        before = watch.compiles
        with watch.stage(own, foreign):
            out = train_steps(layout, RECIPE)
        (recorder,) = layout.parts.comm_plan_recorders
        results[name] = {"losses": out["losses"], "compiles": watch.compiles - before, "calls": list(watch.calls),
                         "moved": list(watch.moved), "forward": recorder.counts("forward"),
                         "backward": recorder.counts("backward")}
        watch.calls.clear()
        watch.moved.clear()
    return results


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_compile_every_setting, 4)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_pipeline_stage_compiles_talk_only_to_their_own_groups(four_ranks, setting):
    for rank, results in enumerate(four_ranks):
        run = results[setting]
        # This rank's stage compiled: its forward, and its backward with it (compile once compiles the backward
        # inside the forward's compile, compile/once.py), or at the first backward (a compile of its own).
        assert run["compiles"] >= 1, (setting, rank, run)
        # The compiled graphs hold the stage's FSDP collectives, which the passes bucket / reorder.
        assert run["forward"].get("all_gather", 0) > 0 and run["backward"].get("reduce_scatter", 0) > 0, run
        assert run["moved"] == [], (setting, rank, run)
        assert all(call.endswith(")") and "world" not in call for call in run["calls"]), (setting, rank, run)
        assert len(run["losses"]) == 1 and 7.0 < run["losses"][0] < 9.0, (setting, rank, run)
