"""Compile once per job (compile/once.py, trainer/precompile.py): one rank compiles each graph and the others load
it, bitwise the same as every rank compiling; a job precompiled from one process compiles nothing; a stale
cache says why it compiles again; a corrupt cache entry is compiled again, never a crash; bad input is one line;
an eager process never imports Inductor's compiler."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.harness import (
    AVG_LOSS,
    COMPILED_JOB,
    DEBUG,
    compile_cache_env,
    read_metrics,
    run_python,
    train_compiled,
    train_py,
)
from titan_simple.compile.cache import LAST_COMPILE, describe_recompile

RUN = (*COMPILED_JOB, "--training.steps", "3")
SUMMARY = re.compile(r"compile once \((?P<folder>[^)]*)\): (?P<text>.*)$", re.MULTILINE)


def _torchrun(dump: Path, cache: Path, *extra: str, ranks: int = 2, threads: str | None = "1") -> str:
    """``RUN`` on ``ranks`` ranks with its graphs in ``cache``, each job's own folder, not the suite's shared one
    (``compile_cache_env``)."""
    return train_compiled(dump, "--training.steps", "3", "--compile.cache_dir", cache, *extra, nproc=ranks,
                          threads=threads)


# What a job's cache folder holds besides the C++ kernels: torch's graph caches, their locks, our markers and plans.
NOT_KERNELS = ("fxgraph", "aotautograd", "locks", "titan_simple_comm_plans", "titan_simple_compile_once",
               "titan_simple_last_compile.json")


def _kernels_of(dump: Path, folder: Path) -> Path:
    """``folder`` holding only the C++ kernels of ``dump``'s cache (the session's ``compiled_job``): a job with its
    graphs there compiles every graph (Dynamo, AOT autograd, Inductor; what the tests count) and finds the kernels of
    the same fusions, the same source g++ would build again byte for byte (issue 61: ~50 C++ compiles a job)."""
    return Path(shutil.copytree(dump / "compile_cache", folder, ignore=lambda _, names: [n for n in names
                                                                                        if n in NOT_KERNELS]))


def _losses(dump: Path) -> list[tuple[float, float]]:
    return [(r[AVG_LOSS], r["grad_norm"]) for r in read_metrics(dump)]


def _summary(output: str) -> str:
    found = SUMMARY.findall(output)
    assert len(found) == 1, output[-3000:]
    return found[0][1]


@pytest.mark.slow
def test_one_rank_compiles_and_the_other_loads_bitwise_equal_to_every_rank_compiling(compiled_job, tmp_path):
    """The job that compiles once (the default) is the session's ``compiled_job`` (tests/conftest.py)."""
    dump, output = compiled_job
    summary = _summary(output)
    # Rank 0 compiled the forward and the backward graph; rank 1 loaded both and compiled none.
    assert re.match(r"rank 0 compiled 2 and loaded 0 FX graphs \(1 Dynamo graphs, [\d.]+ s\); rank\(s\) 1 "
                    r"loaded 2 and compiled 0", summary), summary
    every = tmp_path / "every"
    output_every = _torchrun(every, _kernels_of(dump, tmp_path / "cache_every"), "--compile.compile_on_one_rank",
                             "false")
    assert not SUMMARY.search(output_every)
    assert _losses(dump) == _losses(every)  # losses and grad norms, every step, bitwise
    assert len(_losses(every)) == 3


@pytest.mark.slow
def test_a_precompiled_job_compiles_nothing_and_trains_bitwise_the_same(compiled_job, tmp_path):
    """As the docs say it, with no OMP_NUM_THREADS anywhere: the precompile compiles for one thread per rank, what
    torchrun gives each of its 2 workers (Inductor's CPU kernels are keyed by the count; compiled with this
    machine's default instead, every graph compiled again)."""
    dump, _ = compiled_job
    cache = _kernels_of(dump, tmp_path / "cache")
    pre = train_py(*RUN, "--job.dump_folder", tmp_path / "pre", "--compile.cache_dir", cache,
                   "--compile.precompile_world_size", "2", env=compile_cache_env(threads=None), timeout=1200)
    assert re.search(r"precompile: rank 0 of 2: compiled 2 FX graphs, found 0", pre.stderr), pre.stderr[-3000:]
    assert "compiling for 1 CPU thread(s) per rank (torchrun sets OMP_NUM_THREADS=1" in pre.stderr
    assert "and OMP_NUM_THREADS=1 loads these graphs" in pre.stderr
    assert not (tmp_path / "pre" / "metrics.jsonl").exists()  # it trained nothing

    output = _torchrun(tmp_path / "job", cache, threads=None)
    summary = _summary(output)
    assert summary.startswith("rank 0 compiled 0 and loaded 2 FX graphs"), summary
    assert "rank(s) 1 loaded 2 and compiled 0" in summary, summary
    assert "compile again" not in output  # the same fingerprint as the precompile's
    assert _losses(tmp_path / "job") == _losses(dump)


@pytest.mark.slow
def test_a_corrupt_cache_entry_is_compiled_again(compiled_job, tmp_path):
    """Every file of torch's FX graph and AOT autograd caches truncated: the job compiles, says so, trains."""
    dump, _ = compiled_job
    cache = shutil.copytree(dump / "compile_cache", tmp_path / "cache")
    damaged = 0
    for folder in ("fxgraph", "aotautograd"):
        for path in (cache / folder).rglob("*"):
            if path.is_file():
                path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
                damaged += 1
    assert damaged >= 2
    output = _torchrun(tmp_path / "job", cache)
    assert _losses(tmp_path / "job") == _losses(dump)
    assert re.match(r"rank 0 compiled 2", _summary(output)), _summary(output)


@pytest.mark.slow
def test_an_unreadable_comm_plan_copy_is_compiled_again_not_a_crash(compiled_job, tmp_path):
    """Graphs in torch's cache record no comm plan, so a start that loads them reads the plan's copy; a truncated
    copy (rank 0's) is removed, rank 0 compiles its graphs again without the caches and records the plan anew."""
    dump, _ = compiled_job
    cache = shutil.copytree(dump / "compile_cache", tmp_path / "cache")
    copies = sorted((cache / "titan_simple_comm_plans").glob("*-rank0.json"))
    assert len(copies) == 1
    copies[0].write_text(copies[0].read_text()[:40])
    output = _torchrun(tmp_path / "job", cache)
    assert "comm plan's copy was unreadable (removed); rank 0 compiles its graphs again" in output
    assert _summary(output).startswith("rank 0 compiled every graph without torch's compile caches"), output[-3000:]
    assert _losses(tmp_path / "job") == _losses(dump)
    plan = json.loads((tmp_path / "job" / "comm_plan.json").read_text())["graphs"]
    assert plan == json.loads((dump / "comm_plan.json").read_text())["graphs"]
    assert json.loads(copies[0].read_text())["graphs"] == plan  # the copy written again


def test_a_changed_fingerprint_says_which_part_changed_once(tmp_path):
    parts = (("model", "a"), ("layout and recipe", "b"), ("torch", "2.13.0"), ("titan_simple code", "c"))
    assert describe_recompile(str(tmp_path), "f1", parts, write=True) is None  # an empty folder: nothing to say
    assert describe_recompile(str(tmp_path), "f1", parts, write=True) is None  # the same graphs
    newer = (("model", "a"), ("layout and recipe", "b"), ("torch", "2.14.0"), ("titan_simple code", "d"))
    line = describe_recompile(str(tmp_path), "f2", newer, write=True)
    assert line == (f"compile: the graphs compile again: {tmp_path} last held another run's (torch, titan_simple "
                    "code changed)")
    assert describe_recompile(str(tmp_path), "f2", newer, write=True) is None  # said once
    threads = (*newer, ("CPU threads per process", "2"))  # a job run with other threads than the precompile
    describe_recompile(str(tmp_path), "f2", (*newer, ("CPU threads per process", "1")), write=True)
    line = describe_recompile(str(tmp_path), "f3", threads, write=True)
    assert line == (f"compile: the graphs compile again: {tmp_path} last held another run's (CPU threads per process "
                    "1 -> 2 changed); Inductor keys CPU kernels by the thread count: give the job and whatever "
                    "compiled the folder the same OMP_NUM_THREADS (torchrun sets 1 when it starts several processes "
                    "on a node)")
    (tmp_path / LAST_COMPILE).write_text("{not json")
    assert "unreadable" in describe_recompile(str(tmp_path), "f3", newer, write=False)


def test_a_graph_the_cache_refuses_is_compiled_by_every_rank_without_waiting(tmp_path):
    """AOT autograd's cache refuses some graphs (one tracing an autograd.Function, as float8's matmul does): a
    follower would wait for the whole compile only to compile the graph itself. The leader marks the graph
    ``unshared`` as soon as its cache counted the refusal, and the follower compiles at once."""
    from torch._dynamo.utils import counters

    from titan_simple.compile.once import CompileOnce

    leader = CompileOnce(rank=0, leader=0, folder=tmp_path, cache_folder=str(tmp_path))
    follower = CompileOnce(rank=1, leader=0, folder=tmp_path, cache_folder=str(tmp_path), max_wait_seconds=120)
    finish = threading.Event()

    def leader_compile():
        counters["aot_autograd"]["autograd_cache_bypass"] += 1  # what AOT autograd counts when it refuses a key
        finish.wait(60)  # the rest of a long compile
        return "leader's"

    thread = threading.Thread(target=leader.compile, args=("graph 0", leader_compile))
    thread.start()
    start = time.perf_counter()
    assert follower.compile("graph 0", lambda: "follower's") == "follower's"
    waited = time.perf_counter() - start
    finish.set()
    thread.join()
    assert waited < 30 and (tmp_path / "leader0" / "0.unshared").exists()  # not the leader's 60 s
    assert leader.records[0].unshared and follower.records[0].unshared
    # A graph the cache holds: the follower waits for the leader's compile, and no marker says otherwise.
    thread = threading.Thread(target=leader.compile, args=("graph 1", lambda: time.sleep(2)))
    thread.start()
    start = time.perf_counter()
    follower.compile("graph 1", lambda: None)
    thread.join()
    assert time.perf_counter() - start >= 2 and not (tmp_path / "leader0" / "1.unshared").exists()
    assert not leader.records[1].unshared and not follower.records[1].unshared


def test_precompile_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    """Each refused before anything is built: the precompile's in this process (train.py's ``main``, as the
    command runs it), the training one through train.py in a process of its own (``compile_cache_env``)."""
    import train

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # it would win over [compile] cache_dir

    file = tmp_path / "a_file"
    file.write_text("")
    cases = [
        (("--compile.enable", "--compile.precompile_world_size", "2", "--compile.precompile_device", "cuda"),
         "precompile_device = 'cuda' but this machine has no CUDA GPU"),
        (("--compile.enable", "--compile.precompile_world_size", "2", "--compile.cache_dir", str(file / "sub")),
         f"[compile] cache_dir {str(file / 'sub')!r} cannot be written"),
        (("--compile.enable", "--compile.cache_dir", str(file / "sub")),  # training, too
         f"[compile] cache_dir {str(file / 'sub')!r} cannot be written"),
        (("--compile.precompile_world_size", "2"), "needs [compile] enable = true"),
        (("--compile.enable", "--compile.precompile_world_size", "-1"), "precompile_world_size"),
        (("--compile.enable", "--compile.precompile_world_size", "3", "--parallelism.tensor_parallel_degree", "2"),
         "does not divide"),
    ]
    import torch

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    for args, message in cases:
        if "cuda" in args and _has_cuda():
            continue
        argv = ["--config", "llama3_debug.toml", *args, "--job.dump_folder", str(tmp_path / "dump")]
        if "--compile.precompile_world_size" in args:
            code, stderr = train.main(argv), capsys.readouterr().err
        else:
            done = train_py(*argv, env=compile_cache_env(), timeout=300, expect=None)
            code, stderr = done.returncode, done.stderr
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (args, stderr[-2000:])
        assert "Traceback" not in stderr
        # the precompile's thread count for the job is its own: this process's is as it was
        assert (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")) == (threads, omp), args


def test_an_unwritable_cache_variable_is_one_line_even_for_an_eager_run(tmp_path):
    """torch makes TORCHINDUCTOR_CACHE_DIR when its compiler is imported, which the trainer's modules do even for an
    eager run: train.py checks the variable first (a 30-line traceback from inside torch's import before)."""
    file = tmp_path / "a_file"
    file.write_text("")
    env = {**compile_cache_env(), "TORCHINDUCTOR_CACHE_DIR": str(file / "sub")}
    done = train_py(*DEBUG, "--job.dump_folder", tmp_path / "dump", env=env, timeout=300, expect=None)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: TORCHINDUCTOR_CACHE_DIR '{file / 'sub'}' cannot be written (Not a directory): choose a folder this "
        "process can write and every rank of the job can read."], done.stderr[-2000:]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


EAGER_STEP = """
import sys
import torch
from titan_simple.config import load_job_config
from titan_simple.core.assemble import build_run
from titan_simple.core.plan import resolve_plan
import titan_simple.trainer.trainer  # what train.py imports
config = load_job_config(["--config", "llama3_debug.toml", "--model.n_layers", "1", "--training.seq_len", "16",
                          "--training.local_batch_size", "1"])
plan = resolve_plan(config, 1, "cpu")
run = build_run(plan, torch.device("cpu"))
batch = torch.randint(plan.model_args.vocab_size, (1, 16))
run.step([(batch, batch)])
from titan_simple.parallel.float8_gather import refresh_float8_weights
refresh_float8_weights(run.parts.modules)  # what each validation calls
print("TORCHAO", "torchao" in sys.modules)  # its import logs noise (kernels built for other Pythons, no triton)
loaded = sorted(m for m in sys.modules if m.startswith(("torch._inductor.compile_fx", "torch._inductor.fx_passes",
                                                        "titan_simple.compile.compiler",
                                                        "titan_simple.compile.inductor_private")))
print("LOADED", loaded)
"""


def test_an_eager_run_imports_neither_the_compiler_nor_torchao():
    done = run_python("-c", EAGER_STEP, env=compile_cache_env(), timeout=300)
    assert "LOADED []" in done.stdout and "TORCHAO False" in done.stdout, done.stdout
