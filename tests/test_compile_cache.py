"""Restarts that do not recompile (issue 21): torch's compile caches hold our graphs, a start says whether it
reused them, the comm plan survives a reused graph, anything that changes the graph misses, and a compiled
start prints no torch warning."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil

import pytest

from tests.harness import train_compiled
from titan_simple.compile.cache import use_compile_cache
from titan_simple.compile.comm_plan import CommPlanRecorder
from titan_simple.compile.compiler import _OverlapPass
from titan_simple.config import load_job_config
from titan_simple.core.plan import cpu_has_native_bf16, resolve_plan
from titan_simple.parallel import activation_checkpoint as ac


def _pass(**settings) -> _OverlapPass:
    args = {"bucketing": "transformer_block", "plan": ["tok_embeddings", "layers.0", ["norm", "output"]],
            "reorder": True, "cpu": True, "estimator": None, "recorder": CommPlanRecorder(None, {})} | settings
    return _OverlapPass(**args)


def test_the_post_grad_pass_has_a_stable_cache_key_that_names_its_settings():
    assert _pass().uuid() == _pass().uuid()  # another instance, the same settings: the same key
    keys = {_pass().uuid(), _pass(bucketing="auto", plan=None).uuid(), _pass(reorder=False).uuid(),
            _pass(plan=["tok_embeddings", ["layers.0", "norm", "output"]]).uuid()}
    assert len(keys) == 4
    # The run's compile fingerprint is a part of the key: a graph is reused only where its comm plan's copy,
    # kept under that fingerprint, is found. CI reused a suite-wide cache folder after an edit of this package:
    # the graphs were the same, the fingerprint not, and 6 tests found graphs without a plan.
    assert _pass(fingerprint="run a").uuid() == _pass(fingerprint="run a").uuid()
    assert len({_pass().uuid(), _pass(fingerprint="run a").uuid(), _pass(fingerprint="run b").uuid()}) == 3


def test_checkpoint_context_fns_pickle_and_hash_by_policy():
    """AOTAutograd caches a graph with a selective-checkpoint region only if its context_fn pickles and has a
    cache_hash; different policies must never share one."""
    fns = {
        "full": ac._context_fn(ac.compose_policies(ac.full_recompute_policy)),
        "op": ac._context_fn(ac.compose_policies(ac.SelectiveOpPolicy(every_second_matmul=True))),
        "op_all": ac._context_fn(ac.compose_policies(ac.SelectiveOpPolicy(every_second_matmul=False))),
        "reshard": ac._context_fn(ac.compose_policies(ac.reshard_policy(["group_a"]))),
        "reshard_other": ac._context_fn(ac.compose_policies(ac.reshard_policy(["group_b"]))),
        "reshard_then_op": ac._context_fn(ac.compose_policies(ac.reshard_policy(["group_a"]),
                                                              ac.SelectiveOpPolicy(every_second_matmul=True))),
    }
    for fn in fns.values():
        pickle.dumps(fn)
    assert len({fn.cache_hash for fn in fns.values()}) == len(fns)
    again = ac._context_fn(ac.compose_policies(ac.SelectiveOpPolicy(every_second_matmul=True)))
    assert again.cache_hash == fns["op"].cache_hash
    assert fns["op"]() is not None  # the context_fn still builds its contexts from the named policy


def _fingerprint(*overrides: str, world: int = 2) -> str:
    config = load_job_config(["--config", "llama3_debug.toml", "--compile.enable", *overrides])
    return resolve_plan(config, world, "cpu").compile.fingerprint


def test_the_compile_fingerprint_changes_with_what_changes_the_graphs():
    base = _fingerprint()
    assert base == _fingerprint("--training.steps", "7", "--optimizer.lr", "1e-3", "--job.dump_folder", "/x")
    changed = [
        _fingerprint("--model.flavor", "debugmodel_large"),
        _fingerprint("--training.seq_len", "64"),
        _fingerprint("--training.local_batch_size", "2"),
        _fingerprint("--parallelism.tensor_parallel_degree", "2"),
        _fingerprint(world=1),
        _fingerprint("--activation_checkpoint.mode", "full"),
        _fingerprint("--compile.bucketing", "auto"),
        _fingerprint("--compile.reorder", "false"),
        # the dtype "auto" did not pick on this CPU (bf16 where it computes bf16 natively, else fp32)
        _fingerprint("--training.mixed_precision_param", "float32" if cpu_has_native_bf16() else "bfloat16"),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_cache_folder_is_the_configured_one_unless_the_environment_names_one(tmp_path, monkeypatch):
    from titan_simple.compile.inductor_private import default_inductor_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_inductor_cache_dir())  # what importing torch sets
    assert use_compile_cache(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "explicit"))
    assert use_compile_cache(str(tmp_path / "mine")) == str(tmp_path / "explicit")


# ------------------------------------------------------------------------------ end to end, 2 processes

# A torch warning of a rank: "[rank0]:W1125 ..." (torch's logging) or "...: UserWarning: ..." (Python's). The
# launcher's own banner (torch/distributed/run.py: "Setting OMP_NUM_THREADS ...") is not a rank's.
TORCH_WARNING = re.compile(r"^\[rank\d+\]:[WE]\d{4}|Warning:|warnings\.warn")


def _cache_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "compile cache:" in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.slow
def test_a_resumed_run_reuses_the_compiled_graphs_and_a_changed_one_compiles(compiled_job, tmp_path):
    """The first run is the session's ``compiled_job`` (tests/conftest.py: 3 steps, a checkpoint at steps 2 and 3,
    its cache under its dump folder); this test resumes a copy of it for one more step."""
    shared, first = compiled_job
    assert re.search(rf"compile cache: compiled 2 graphs \({re.escape(str(shared / 'compile_cache'))}\)",
                     _cache_line(first))
    warnings = [line for line in first.splitlines() if TORCH_WARNING.search(line)]
    assert warnings == []  # a quiet start: the ranks print no torch warning
    dump = tmp_path / "run"
    shutil.copytree(shared, dump)
    plan = json.loads((dump / "comm_plan.json").read_text())
    assert plan["graphs"]["forward"] and plan["graphs"]["backward"]
    (dump / "comm_plan.json").unlink()
    (dump / "comm_plan.txt").unlink()

    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    resumed = train_compiled(dump, "--training.steps", "4", *checkpoint)
    assert "resum" in resumed.lower()
    line = _cache_line(resumed)
    assert "reused all 2 compiled graphs" in line and "comm plan restored from the cache" in line, line
    assert json.loads((dump / "comm_plan.json").read_text())["graphs"] == plan["graphs"]
    assert [line for line in resumed.splitlines() if TORCH_WARNING.search(line)] == []

    # Another setting of our pass is another graph: the same cache folder, no graph reused (the C++ kernels of
    # the same fusions are, which a new sequence length would build again with g++).
    other = train_compiled(tmp_path / "other", "--training.steps", "1", "--compile.reorder", "false",
                           "--compile.cache_dir", str(dump / "compile_cache"))
    assert "compile cache: compiled 2 graphs" in _cache_line(other)
    # ... and the start says why, once: the folder last held the first run's graphs, another recipe.
    why = [line for line in other.splitlines() if "compile again" in line]
    assert len(why) == 1 and "(layout and recipe changed)" in why[0], why
    assert not any("compile again" in line for line in resumed.splitlines())
