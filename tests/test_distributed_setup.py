"""What the process sets up before and around its process group (``trainer/distributed.py``): the CUDA allocator
and NCCL variables (set only for CUDA, never over a user's value), and the collective timeouts (start-up, then
training), which reach every process group of the mesh, gloo's here as NCCL's on GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed_utils import run_on_ranks
from tests.harness import job_env, run_python
from titan_simple.config import load_job_config
from titan_simple.errors import ConfigError
from titan_simple.trainer.distributed import (
    allocator_environment,
    nccl_environment,
    prepare_process_environment,
)

NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}


def config(tmp_path: Path, *extra: str):
    return load_job_config(["--job.dump_folder", str(tmp_path), *extra])


# ---------------------------------------------------------------------------------------------- allocator


def test_expandable_segments_are_set_unless_the_user_configured_the_allocator():
    assert allocator_environment({}, True) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_environment({}, False) == {}
    assert allocator_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, True) == {}
    assert allocator_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, True) == {}


def test_the_allocator_setting_reaches_torchs_allocator_config(tmp_path):
    """In a fresh process (torch reads the variable once), the value set after ``import torch`` and before CUDA
    starts is what torch's allocator config holds (the device-generic one, which the CPU wheel has too)."""
    script = ("import os, torch\n"
              "from titan_simple.config import load_job_config\n"
              "from titan_simple.trainer.distributed import prepare_process_environment\n"
              f"lines = prepare_process_environment(load_job_config(['--job.dump_folder', {str(tmp_path)!r}]), "
              "'cuda')\n"
              "print(lines[0])\n"
              "print(torch._C._accelerator_getAllocatorSettings())\n")
    env = job_env(drop=("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    out = run_python("-c", script, env=env).stdout.splitlines()
    assert out == ["allocator | set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "expandable_segments:True"]


# ---------------------------------------------------------------------------------------------- NCCL


def test_nccl_defaults_name_every_variable_torch_reads(tmp_path):
    changes = nccl_environment({}, 20000, str(tmp_path / "comm_traces" / "rank_"))
    assert set(changes.set) == NCCL_DEFAULTS and changes.kept == {}
    assert changes.set["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert changes.set["TORCH_FR_BUFFER_SIZE"] == changes.set["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert changes.set["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert changes.set["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
    assert changes.set["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == changes.set["TORCH_FR_DUMP_TEMP_FILE"]


def test_nccl_defaults_never_override_a_users_value():
    """A user's value under any name of a setting (the old TORCH_NCCL_* or the newer TORCH_FR_* one) keeps the
    whole setting theirs."""
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    changes = nccl_environment(user, 20000, "/run/comm_traces/rank_")
    assert changes.kept == user
    assert set(changes.set) == {"TORCH_NCCL_DUMP_ON_TIMEOUT"}


def test_a_zero_trace_buffer_turns_the_flight_recorder_off():
    changes = nccl_environment({}, 0, "unused")
    assert changes.set == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "0",
                           "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def test_cuda_runs_get_the_variables_and_a_log_line(tmp_path):
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    lines = prepare_process_environment(config(tmp_path, "--comm.init_timeout_seconds", "3600"), "cuda", environ)
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
    assert (tmp_path / "comm_traces").is_dir()  # every rank writes its dump there on a timeout
    assert lines[0] == "allocator | set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert lines[1].startswith("comm: nccl, timeouts 3600 s until the first step has ended, then 600 s | set ")
    assert lines[1].endswith(" | kept yours: TORCH_NCCL_ASYNC_ERROR_HANDLING=1")


def test_fault_tolerance_fixes_the_nonblocking_timeout_before_any_group_exists(tmp_path):
    """torchft's replica group runs NCCL non-blocking; torch reads TORCH_NCCL_NONBLOCKING_TIMEOUT once per process,
    so it is set with the other variables, from [fault_tolerance] timeout_seconds, before any group is built."""
    environ: dict[str, str] = {}
    prepare_process_environment(config(tmp_path, "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                                       "--fault_tolerance.timeout_seconds", "45"), "cuda", environ)
    assert environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "45"
    plain: dict[str, str] = {}
    prepare_process_environment(config(tmp_path), "cuda", plain)
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in plain


def test_cpu_runs_touch_no_variable(tmp_path):
    environ: dict[str, str] = {}
    lines = prepare_process_environment(config(tmp_path), "cpu", environ)
    assert environ == {} and not (tmp_path / "comm_traces").exists()
    assert lines == ["comm: gloo, timeouts 1800 s until the first step has ended, then 600 s"]


def test_expandable_segments_can_be_turned_off(tmp_path):
    environ: dict[str, str] = {}
    lines = prepare_process_environment(config(tmp_path, "--training.expandable_segments", "false"), "cuda", environ)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in environ and lines[0] == "allocator | torch's defaults"


@pytest.mark.parametrize(("key", "value"), [("init_timeout_seconds", "0"), ("train_timeout_seconds", "-1"),
                                            ("trace_buf_size", "-5"), ("save_traces_folder", "/abs")])
def test_comm_keys_are_checked(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"\[comm\] {key}"):
        config(tmp_path, f"--comm.{key}", value)


# ---------------------------------------------------------------------------------------------- timeouts


def _timeouts_of_every_group(rank: int, world_size: int) -> list[list[float]]:
    from tests.distributed_utils import gloo_worker_threads
    from titan_simple.parallel.dims import ParallelDims
    from titan_simple.parallel.torch_private import process_group_timeout_seconds
    from titan_simple.trainer.distributed import set_timeouts

    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1, pp=1, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    groups = dims.process_groups(mesh)  # dp_replicate, dp_shard and the flattened dp

    def read() -> list[float]:
        return [process_group_timeout_seconds(g) for g in [None, *groups]]

    seen = [[float(len(groups))], [float(gloo_worker_threads(g)) for g in [None, *groups]], read()]
    set_timeouts(groups, 1234)
    seen.append(read())
    set_timeouts(groups, 77)
    seen.append(read())
    return seen


@pytest.mark.slow
def test_timeouts_reach_the_default_group_and_every_mesh_group():
    """torch gives a new group its backend's default timeout (gloo 30 min, NCCL 10 min), not the default group's;
    set_timeouts reaches all of them. Every group, the mesh's included, runs gloo on one worker thread."""
    for count, threads, initial, start_up, training in run_on_ranks(_timeouts_of_every_group, 4):
        assert count == [3.0]
        assert threads == [1.0] * 4
        assert initial[1:] == [1800.0, 1800.0, 1800.0]  # gloo's default for new groups
        assert start_up == [1234.0] * 4
        assert training == [77.0] * 4


def _trainer_timeouts(rank: int, world_size: int, dump: str) -> tuple[list[float], list[float]]:
    import torch

    from titan_simple.core.step import StepHooks
    from titan_simple.parallel.torch_private import process_group_timeout_seconds
    from titan_simple.trainer.distributed import DistInfo
    from titan_simple.trainer.trainer import Trainer

    config = load_job_config(["--config", "llama3_debug.toml", "--training.steps", "3", "--training.seq_len", "32",
                              "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
                              "--job.dump_folder", dump, "--comm.init_timeout_seconds", "999",
                              "--comm.train_timeout_seconds", "111"])
    trainer = Trainer(config, DistInfo(rank, world_size, rank, torch.device("cpu")))
    seen: list[float] = []

    class Watch(StepHooks):
        def begin(self) -> None:
            seen.append(process_group_timeout_seconds())

    trainer.run.step.hooks = Watch()
    trainer.train()
    return seen, [process_group_timeout_seconds(g) for g in trainer.process_groups]


@pytest.mark.slow
def test_the_trainer_waits_longer_until_the_first_step_has_ended(tmp_path):
    for during_steps, mesh_groups in run_on_ranks(_trainer_timeouts, 2, args=(str(tmp_path),)):
        assert during_steps == [999.0, 111.0, 111.0]
        assert mesh_groups and all(seconds == 111.0 for seconds in mesh_groups)


def test_the_trainer_gives_every_gloo_group_one_worker_thread(monkeypatch):
    """The trainer's own process-group start installs the gloo workaround (test ranks start theirs in
    tests/distributed_utils.py, so the trainer skips this path there)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from titan_simple.trainer.distributed import DistInfo, init_process_group

    helper = c10d._new_process_group_helper
    monkeypatch.setattr(c10d, "_new_process_group_helper", getattr(helper, "__wrapped__", helper))
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    init_process_group(DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu")))
    assert [call["backend"] for call in calls] == ["gloo"]
    assert getattr(c10d._new_process_group_helper, "one_gloo_worker_thread", False)
