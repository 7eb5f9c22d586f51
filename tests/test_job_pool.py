"""The suite's pool of worlds that stay up (tests/job_pool.py): a job in it trains as a launched job does, whatever
ran before it, and a job that leaves state behind is caught.

The jobs whose order is swapped differ in what a process keeps: one compiled (Dynamo's caches, Inductor's config,
compile once's leader and loader), one eager under tensor parallel with deterministic mode and another seed (a
mesh of subgroups, torch's global flags, the RNG)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import FP32, ONE_ROW, logged_losses, train_py
from tests.job_pool import JobLeftState, NotForThePool, run_job

pytestmark = pytest.mark.slow

COMPILED = (*ONE_ROW, "--model.n_layers", "1", *FP32, "--training.steps", "2", "--compile.enable")
TP_DETERMINISTIC = (*ONE_ROW, "--model.n_layers", "1", *FP32, "--training.steps", "3",
                    "--parallelism.tensor_parallel_degree", "2", "--training.deterministic", "--training.seed", "7")


def test_two_jobs_in_either_order_in_the_pool_train_as_fresh_processes(tmp_path):
    """Compiled then TP-deterministic, and TP-deterministic then compiled, on the same 2-rank world: every loss of
    each job bitwise its loss in freshly launched processes."""
    fresh = {}
    for name, job in (("compiled", COMPILED), ("tp", TP_DETERMINISTIC)):
        train_py(*job, "--job.dump_folder", tmp_path / f"fresh_{name}", nproc=2, launch=True)
        fresh[name] = logged_losses(tmp_path / f"fresh_{name}")
    for order in (("compiled", "tp"), ("tp", "compiled")):
        for name in order:
            folder = tmp_path / f"pool_{'_'.join(order)}_{name}"
            job = COMPILED if name == "compiled" else TP_DETERMINISTIC
            proc = run_job([*job, "--job.dump_folder", str(folder)], nproc=2)
            assert proc.returncode == 0 and proc.rank_codes == [0, 0], proc.stderr[-3000:]
            assert logged_losses(folder) == fresh[name], (order, name)
    assert len(fresh["compiled"]) == 2 and len(fresh["tp"]) == 3


# ----------------------------------------------------------------------------- jobs that are not train.py's


def leave_a_thread(argv: list[str]) -> int:
    threading.Thread(target=time.sleep, args=(30,), name="left_behind", daemon=True).start()
    return 0


def leave_a_child_process(argv: list[str]) -> int:
    subprocess.Popen(["sleep", "30"])
    return 0


def leave_a_process_group(argv: list[str]) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return 0


def change_what_the_pool_puts_back(argv: list[str]) -> int:
    """Everything a job may change that the pool restores, changed; and a compiled function left in Dynamo."""
    import logging

    import torch
    import torch._inductor.config

    os.environ["TITAN_JOB_POOL_PROBE"] = "left"
    os.chdir("/")
    torch.manual_seed(12345)
    torch.set_num_threads(3)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)
    torch._inductor.config.max_autotune = True
    signal.signal(signal.SIGTERM, lambda *_: None)
    logging.getLogger("titan_simple").setLevel(logging.DEBUG)
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    return 0


def report_state(argv: list[str]) -> int:
    """What the next job meets, into ``argv[0]`` (JSON)."""
    import logging

    import torch
    import torch._inductor.config

    state = {
        "probe": os.environ.get("TITAN_JOB_POOL_PROBE"), "cwd": os.getcwd(),
        "rng": torch.get_rng_state()[:64].tolist(), "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(), "dtype": str(torch.get_default_dtype()),
        "max_autotune": torch._inductor.config.max_autotune,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "titan_level": logging.getLogger("titan_simple").level,
    }
    Path(argv[0]).write_text(json.dumps(state))
    return 0


def fail(argv: list[str]) -> int:
    raise RuntimeError("this job fails")


ENTRY = f"{__name__}:"


def test_a_job_that_leaves_state_behind_fails_and_what_the_pool_puts_back_is_back(tmp_path):
    """A thread, a child process or a process group left by a job: ``JobLeftState`` naming it (and the next job
    runs in a new world). The environment, working directory, RNG, threads, deterministic mode, default dtype,
    Inductor's config, signal handlers and loggers a job changed are as before for the next job."""
    for entry, what in (("leave_a_thread", "thread 'left_behind'"), ("leave_a_child_process", "child process"),
                        ("leave_a_process_group", "a process group")):
        with pytest.raises(JobLeftState, match=what):
            run_job([], entry=ENTRY + entry)
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    assert run_job([str(before)], entry=ENTRY + "report_state").returncode == 0
    assert run_job([], entry=ENTRY + "change_what_the_pool_puts_back").returncode == 0
    assert run_job([str(after)], entry=ENTRY + "report_state").returncode == 0
    assert json.loads(after.read_text()) == json.loads(before.read_text())
    failed = run_job([], entry=ENTRY + "fail")
    assert failed.returncode == 1 and "RuntimeError: this job fails" in failed.stderr  # as an interpreter reports


def test_a_job_for_another_import_time_environment_is_not_for_the_pool():
    """Torch read TORCHINDUCTOR_* when the forkserver imported it: a job asking for other values is launched."""
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    with pytest.raises(NotForThePool, match="TORCHINDUCTOR_"):
        run_job([], env=env, entry=ENTRY + "fail")
    with pytest.raises(NotForThePool, match="3 ranks"):
        run_job([], nproc=3, entry=ENTRY + "fail")
    assert sys.modules["tests.job_pool"].WORLD_SIZES == (1, 2, 4)


def _what_a_fork_starts_with(rank: int, world_size: int) -> dict:
    import threading

    import torch._dynamo.utils
    from torch._inductor import cpu_vec_isa
    from torch._inductor.async_compile import AsyncCompile

    return {"codegen loaded": "torch._inductor.codegen.cpp" in sys.modules,
            "vector ISA probed": cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1,
            "no inherited compile pool": AsyncCompile.pool.cache_info().currsize == 0,
            "counters empty": not any(torch._dynamo.utils.counters.values()),
            "threads": sorted(t.name for t in threading.enumerate())}


def test_a_forked_rank_starts_with_the_compiler_warm_and_no_half_made_threads():
    """tests/forkserver_warmup.py: the server compiled once (the C++ code generator loaded, the vector ISA probed),
    then shut Inductor's compile thread pool and cleared Dynamo's counters; a fork holds only its main thread. The
    private names the warm-up uses fail here first if torch changes them."""
    from tests.distributed_utils import run_on_ranks

    state = run_on_ranks(_what_a_fork_starts_with, 1)[0]
    assert state.pop("threads") in (["MainThread"], ["MainThread", "tqdm_monitor"])
    assert all(state.values()), state
