"""Fault-tolerant replica groups (titan_simple/trainer/fault_tolerance.py, scripts/fault_tolerance.py).

The slow cases run the real thing: a torchft lighthouse and two replica groups of two torchrun processes each
(debug model, gloo), with failures rehearsed by scripts/fault_tolerance.py --kill (a group stops at a step and
is SIGKILLed there, process tree and all) and restarts. They check the survivors' steps, the uncommitted steps,
the shard hashes of both groups after every rejoin, and the losses against a plain 4-process fully_shard run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed_utils import single_rank_process_group
from tests.harness import (
    NO_TENSORBOARD,
    REPO,
    TWO_BLOCKS,
    finish,
    free_port,
    job_env,
    load_script,
    read_jsonl,
    read_metrics,
    report,
    run_python,
    start_python,
    stop,
    train_py,
    wait_for_logged_steps,
)
from tests.parity import COMPILED_RTOL, EAGER_RTOL, SHARDED_NORM_RTOL, max_rel_diff
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.parallel.dims import ParallelDims
from titan_simple.parallel.simple_fsdp import data_parallel
from titan_simple.trainer.fault_tolerance import (
    FAILURE_ENV,
    REPLICA_NCCL_ERROR_HANDLING,
    FailureInjection,
    check_fault_tolerance,
    check_reachable,
    replica_nccl_group_class,
)
from titan_simple.trainer.loop_feature import Progress
from titan_simple.trainer.metrics import LIVE_GROUPS, _format_console_line
from titan_simple.trainer.replica_state import GradientBuckets, ReplicaState, recovery_timeout, state_bytes

TORCHRUN_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# Two layers of the debug model; a constant rate after a 2-step warmup: runs of different lengths follow the same
# schedule step by step.
TINY = (*TWO_BLOCKS, "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_ratio", "0", *NO_TENSORBOARD)
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse",
      "http://127.0.0.1:1"]


def ft_config(*extra: str):
    return load_job_config([*TINY, *FT, *extra])


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("extra, key", [
    (["--fault_tolerance.replica_id", "2"], "replica_id = 2 is impossible; expected this group's index, 0 .. "),
    (["--fault_tolerance.min_replica_size", "3"], "min_replica_size = 3 is impossible"),
    (["--fault_tolerance.group_size", "0"], "group_size = 0 is impossible"),
])
def test_impossible_keys_are_one_line(extra, key):
    with pytest.raises(ConfigError, match=key) as error:
        ft_config(*extra)
    assert "\n" not in str(error.value)


def test_hybrid_shard_is_refused_in_one_line():
    config = ft_config("--parallelism.data_parallel_replicate_degree", "2")
    with pytest.raises(ConfigError, match="hybrid_shard.*cannot lose a member") as error:
        check_fault_tolerance(config, ParallelDims.from_config(config, 4), environ=TORCHRUN_ENV)
    assert "\n" not in str(error.value)


def test_an_unreachable_lighthouse_is_one_line_before_anything_starts():
    port = free_port()  # nothing listens there
    config = ft_config("--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=f"lighthouse http://127.0.0.1:{port} cannot be reached.*start it first"):
        check_fault_tolerance(config, ParallelDims.from_config(config, 2), environ=TORCHRUN_ENV)
    with pytest.raises(ConfigError, match="is not an address like"):
        check_reachable("http://no-port-here")


def test_a_missing_lighthouse_or_torchrun_is_one_line(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    config = ft_config("--fault_tolerance.lighthouse", "")
    dims = ParallelDims.from_config(config, 2)
    with pytest.raises(ConfigError, match="needs a lighthouse: set \\[fault_tolerance\\] lighthouse"):
        check_fault_tolerance(config, dims, environ=TORCHRUN_ENV)
    with pytest.raises(ConfigError, match="needs torchrun"):
        check_fault_tolerance(config, dims, environ={})


def test_a_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    config = ft_config()
    with pytest.raises(ConfigError, match=r"needs torchft: pip install -e '\.\[ft\]'"):
        check_fault_tolerance(config, ParallelDims.from_config(config, 2), environ=TORCHRUN_ENV)


def test_a_bad_failure_setting_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(FAILURE_ENV, "sometime:3")
    with pytest.raises(ConfigError, match="expected between:STEP, allreduce:STEP or hold:STEP"):
        FailureInjection.from_environment(str(tmp_path), 0)


# ------------------------------------------------------------------------------------------ pieces


def test_the_global_batch_spans_every_group():
    config = ft_config("--training.global_batch_size", "16")  # 2 groups x 2 dp ranks x 2 rows x 2 microbatches
    plan = resolve_plan(config, 2, "cpu")
    assert plan.accumulation_steps == 2 and plan.data.global_rows == 16
    plain = resolve_plan(load_job_config([*TINY, "--training.global_batch_size", "16"]), 2, "cpu")
    assert plain.accumulation_steps == 4 and plain.data.global_rows == 16


class _Allocations(TorchDispatchMode):
    """The bytes of the tensors the ops inside create (outputs that are not views of an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _backward(model, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).square().sum().backward()


def test_gradients_live_in_one_buffer_and_averaging_copies_nothing():
    """The first step moves the gradient shards into one flat buffer (``.grad`` becomes a view of it); later steps
    zero it in place, autograd accumulates into it, and the buffers to all-reduce are that buffer, with nothing
    allocated (measured: 0 bytes; the buckets as they were, one concatenated copy per bucket every step, allocated
    the whole gradient again)."""
    with single_rank_process_group():
        model, optimizer, _ = _sharded_model_and_optimizer(seed=0)
        params = list(model.parameters())
        buckets = GradientBuckets(cap_bytes=64)
        _backward(model, seed=1)
        expected = [p.grad.to_local().clone() for p in params]
        (flat,) = buckets.buffers(params)
        assert flat.numel() == sum(p.to_local().numel() for p in params)
        assert all(torch.equal(p.grad.to_local(), e) for p, e in zip(params, expected, strict=True))
        optimizer.zero_grad(set_to_none=False)  # what the step does with replica groups
        _backward(model, seed=2)
        counter = _Allocations()
        with counter:
            (again,) = buckets.buffers(params)
        assert counter.bytes == 0 and again.data_ptr() == flat.data_ptr()
        offset = 0
        for p in params:  # the gradients of step 2, accumulated where step 1's were
            local = p.grad.to_local()
            assert local.data_ptr() == flat[offset:].data_ptr()
            offset += local.numel()
        assert [s.numel() for s in buckets.slices(flat)] == [16] * (flat.numel() // 16) + (
            [flat.numel() % 16] if flat.numel() % 16 else [])
        optimizer.zero_grad()  # an uncommitted step frees them: the next average puts them back
        _backward(model, seed=3)
        (third,) = buckets.buffers(params)
        assert third.data_ptr() == flat.data_ptr() and params[0].grad.to_local().data_ptr() == flat.data_ptr()


def test_bf16_averaging_casts_into_its_own_buffer_and_back():
    with single_rank_process_group():
        model, _, _ = _sharded_model_and_optimizer(seed=0)
        params = list(model.parameters())
        buckets = GradientBuckets(cap_bytes=2**20, in_bf16=True)
        _backward(model, seed=1)
        exact = [p.grad.to_local().clone() for p in params]
        (buffer,) = buckets.buffers(params)
        assert buffer.dtype == torch.bfloat16
        buffer.mul_(2)  # what an all-reduce of two equal groups' sums does, before torchft's division
        buckets.finish()
        for p, e in zip(params, exact, strict=True):
            torch.testing.assert_close(p.grad.to_local(), 2 * e.bfloat16().float(), rtol=0, atol=0)


def test_recovery_timeout_follows_the_state():
    state = {"params": [torch.zeros(250_000), torch.zeros(250_000)], "optimizer": [{"exp_avg": (torch.zeros(500_000),
                                                                                                  True)}],
             "progress": {"step": 3}}
    assert state_bytes(state) == 4_000_000
    assert recovery_timeout(state_bytes(state), 60.0, 1.0).total_seconds() == pytest.approx(60.004)
    # Llama 3 405B on 512 GPUs, 8 per group: about 9.5 GB of fp32 shards and AdamW state per rank.
    assert recovery_timeout(int(405e9 * 12 / 512), 60.0, 1.0).total_seconds() == pytest.approx(69.49, abs=0.01)


def test_the_replica_nccl_group_aborts_communicators_instead_of_ending_the_process(monkeypatch):
    """torchft's NCCL group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING = 2 (abort the failed communicator, keep the
    process); the process's own value (3, for our groups) is back as soon as it is built. No GPU here: the parent's
    constructor is replaced by a probe of the environment it would read."""
    from torchft.process_group import ProcessGroupNCCL

    seen = []
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    def probe(self, store, rank, world_size):
        seen.append(os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"])

    monkeypatch.setattr(ProcessGroupNCCL, "_create_pg", probe)
    cls = replica_nccl_group_class()
    group = cls.__new__(cls)  # no constructor: it asks for NCCL's version, which a CPU build lacks
    group._create_pg(None, 0, 2)
    assert seen == [REPLICA_NCCL_ERROR_HANDLING] == ["2"]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.slow
def test_a_2gb_heal_over_the_replica_group_finishes_within_the_recovery_timeout():
    """A rank's 2.15 GB of state sent to a healing rank through torchft's process-group transport over the replica
    group, as titan_simple builds it (gloo here), received in place and checked bitwise, within the timeout the code
    derives for that size (measured: docs/fault_tolerance.md, scripts/benchmarks/benchmark_heal.py)."""
    # In the user's environment: its time is compared with the limit.
    result = run_python(REPO / "scripts" / "benchmarks" / "benchmark_heal.py", "--gb", "2", "--transports", "pg",
                        env=os.environ, timeout=900)
    row = [cells.strip() for cells in result.stdout.strip().splitlines()[-1].strip("|").split("|")]
    size_gb, seconds, limit, bitwise = float(row[0].split()[0]), float(row[2]), float(row[4].split()[0]), row[5]
    assert size_gb >= 2.0 and bitwise == "yes"
    assert limit == pytest.approx(recovery_timeout(int(size_gb * 1e9), 60.0, 1.0).total_seconds(), abs=1)
    print(f"2 GB heal: {seconds:.2f} s, limit {limit:.0f} s")
    assert seconds < limit


def test_the_step_line_shows_the_live_groups():
    line = _format_console_line(3, {"loss_metrics/global_avg_loss": 5.0, LIVE_GROUPS: 1.0}, 10, None)
    assert "loss 5.0000 | groups 1" in line


def _sharded_model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    model = data_parallel(model, init_device_mesh("cpu", (1,)), "fully_shard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_a_fresh_group_heals_into_exactly_the_live_state():
    """The heal path a restarted group takes: its optimizer has no state yet (AdamW creates it lazily), so the
    received shards become DTensors sharded like their parameters; afterwards both step bitwise alike."""
    with single_rank_process_group():
        live = _sharded_model_and_optimizer(seed=0)
        for step in range(3):
            _train_step(*live, seed=step)
        fresh = _sharded_model_and_optimizer(seed=1)  # other weights, no optimizer state, schedule at 0
        progress = Progress(global_step=3, tokens_seen=96, consumed_samples=12)
        sent = ReplicaState(list(live[0].parameters()), live[1], live[2], lambda: progress)
        received = ReplicaState(list(fresh[0].parameters()), fresh[1], fresh[2], lambda: Progress(0, 0, 0))
        assert received.digests() != sent.digests()
        assert received.load_state_dict(sent.state_dict()) == progress
        assert received.digests() == sent.digests()
        assert fresh[1].param_groups[0]["lr"] == live[1].param_groups[0]["lr"] == 0.1 * 0.5 ** 3
        _train_step(*live, seed=7)
        _train_step(*fresh, seed=7)
        assert received.digests() == sent.digests()
        for a, b in zip(live[0].parameters(), fresh[0].parameters(), strict=True):
            assert torch.equal(a.to_local(), b.to_local())


# ------------------------------------------------------------------------------------------ the launcher

LAUNCHER = REPO / "scripts" / "fault_tolerance.py"


def run_launcher(*argv: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return run_python(LAUNCHER, *argv, timeout=timeout, expect=None)


@pytest.mark.parametrize("argv, says", [
    (["--groups", "0"], "--groups 0: expected at least 1"),
    (["--kill", "1:x:between"], "--kill 1:x:between: expected GROUP:STEP:between|allreduce"),
    (["--kill", "5:3:between"], "with GROUP < 2"),
    (["--hold", "one"], "--hold one: expected GROUP:STEP"),
    (["--restart", "3", "--", "--config", "llama3_debug.toml", "--training.stepz", "5"],
     "unknown key 'stepz' in [training]. Did you mean 'steps'?"),
    (["--dump-folder", "/tmp/a", "--", "--config", "llama3_debug.toml", "--job.dump_folder", "/tmp/b"],
     "--dump-folder /tmp/a and -- --job.dump_folder /tmp/b differ; give one of them"),
])
def test_bad_launcher_arguments_are_one_line_and_exit_2_before_anything_starts(argv, says, tmp_path):
    if "--" not in argv:
        argv = [*argv, "--", "--config", "llama3_debug.toml", "--job.dump_folder", str(tmp_path)]
    result = run_launcher(*argv)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "launcher_events.json").exists()


def test_the_launcher_writes_where_the_config_says(tmp_path):
    launcher = load_script(LAUNCHER, "ft_launcher")
    args, train = launcher.parse_args(["--", "--config", "llama3_debug.toml", "--job.dump_folder", str(tmp_path)])
    assert launcher.job_folder(args, train) == tmp_path
    args, train = launcher.parse_args(["--", "--config", "llama3_8b.toml"])
    assert launcher.job_folder(args, train) == Path("outputs/llama3_8b").resolve()  # the TOML's, as train.py's
    args, train = launcher.parse_args(["--dump-folder", str(tmp_path / "x"), "--", "--config", "llama3_8b.toml"])
    assert launcher.job_folder(args, train) == tmp_path / "x"


@pytest.mark.slow
def test_a_group_that_exits_with_a_config_error_is_not_restarted_and_says_why(tmp_path):
    result = run_launcher("--restart", "3", "--", "--config", "llama3_debug.toml", "--job.dump_folder", str(tmp_path),
                          "--model.tokenizer_path", str(tmp_path / "missing.json"), timeout=300)
    assert result.returncode == 1
    events = json.loads((tmp_path / "launcher_events.json").read_text())
    assert [e["event"] for e in events].count("launch") == 2  # one per group, no relaunch
    assert [e["event"] for e in events].count("not_restarted") == 2
    assert "tokenizer file not found" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_a_lighthouse_that_dies_mid_run_is_one_line_naming_it(tmp_path):
    """Two groups of one process train against a lighthouse this test started; it is SIGKILLed after a few steps.
    Each group stops at its next quorum (quorum_timeout_seconds 10) with one line naming the lighthouse, no
    traceback of the rank, exit status 2 (not restarted by the launcher), and run_status.json says failed with that
    line."""
    port = free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
                                   "--bind", f"[::]:{port}", "--heartbeat_timeout_ms", "2000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ,
                                                                                             "RUST_LOG": "warn"})
    dump = tmp_path / "job"
    launcher = start_python(LAUNCHER, "--groups", "2", "--nproc", "1", "--restart", "2", "--lighthouse",
                            f"http://127.0.0.1:{port}", "--", *TINY, "--model.n_layers", "1", "--training.steps", "500",
                            "--job.dump_folder", dump, "--fault_tolerance.quorum_timeout_seconds", "10")
    try:
        wait_for_logged_steps(launcher, dump / "replica_0" / "metrics.jsonl", 3, timeout_s=240)
    finally:
        stop(lighthouse)
    console = finish(launcher, timeout_s=240)
    assert launcher.returncode == 1, console[-3000:]
    for group in (0, 1):
        log = (dump / f"replica_{group}" / "launch_0.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"the torchft lighthouse at http://127.0.0.1:{port} stopped answering" in errors[0]
        assert "titan_simple/train" not in log  # no traceback through our code (torchrun adds its own summary)
        status = json.loads((dump / f"replica_{group}" / "run_status.json").read_text())
        assert status["state"] == "failed" and "stopped answering" in status["error"]
    said = [line for line in console.splitlines() if line.startswith("[launcher] group")]
    assert len(said) == 2 and all("stopped answering" in line for line in said) and "not_restarted" in console


# ------------------------------------------------------------------------------------------ real runs


def launch(dump: Path, steps: int, *extra: str, kills: tuple[str, ...] = (), hold: str = "", restart: int = 0,
           env: dict[str, str] | None = None, timeout: int = 900) -> list[dict]:
    """scripts/fault_tolerance.py with two groups of two processes; returns the launcher's events."""
    result = run_python(LAUNCHER, "--groups", "2", "--nproc", "2", "--dump-folder", dump, "--restart", str(restart),
                        "--heartbeat-timeout-ms", "2000", *[f"--kill={k}" for k in kills],
                        *([f"--hold={hold}"] if hold else []), "--", *TINY, "--training.steps", str(steps),
                        "--fault_tolerance.log_shard_hashes", "--fault_tolerance.timeout_seconds", "30",
                        "--fault_tolerance.bucket_cap_mb", "0.5",  # several buckets: a kill can fall between two
                        *extra, env=job_env(**(env or {})), timeout=timeout, expect=None)
    logs = "".join(p.read_text()[-3000:] for p in sorted(dump.glob("replica_*/launch_*.log")))
    assert result.returncode == 0, report(result) + logs
    return json.loads((dump / "launcher_events.json").read_text())


@pytest.fixture(scope="module")
def plain_four_processes(tmp_path_factory) -> list[dict]:
    """The reference: SimpleFSDP fully_shard on 4 processes, the same global batch (4 x 2 rows), eager."""
    dump = tmp_path_factory.mktemp("plain4")
    train_py(*TINY, "--training.steps", "4", "--job.dump_folder", dump, nproc=4)
    return read_metrics(dump)


def hashes(dump: Path, group: int, rank: int) -> dict[int, tuple[str, str]]:
    """The last hash line of every step (a group that healed may log a step number twice: keep the latest)."""
    lines = read_jsonl(dump / f"replica_{group}" / f"shard_hashes_rank{rank}.jsonl")
    return {line["step"]: (line["params"], line["optimizer"]) for line in lines}


def check_failures(dump: Path, events: list[dict], steps: int, kills: tuple[str, ...]) -> list[dict]:
    """What every failure run must show; returns the survivor's metrics."""
    launches = [(e["group"], e["attempt"]) for e in events if e["event"] == "launch"]
    assert launches.count((0, 0)) == 1 and all(g == 1 for g, a in launches if a > 0)  # group 0 never restarted
    assert len([e for e in events if e["event"] == "killed"]) == len(kills)
    survivor = read_metrics(dump / "replica_0")
    # Every step logged once, in order: no step lost, none repeated (a retried step logs once, when it commits).
    assert [m["step"] for m in survivor] == list(range(1, steps + 1))
    restarted = read_metrics(dump / "replica_1")
    assert restarted[-1]["step"] == steps
    for log in (dump / "replica_1").glob("launch_*.log"):  # a heal is one warning line, nothing of torch's or HTTP's
        text = log.read_text()
        assert "not writable" not in text and "GET /checkpoint" not in text, log
    for rank in (0, 1):
        survivor_hashes, rejoined = hashes(dump, 0, rank), hashes(dump, 1, rank)
        after_rejoin = [s for s in rejoined if s > int(kills[0].split(":")[1])]
        assert len(after_rejoin) >= 4
        # After each rejoin, both groups' parameter and optimizer shards are bitwise equal at every step.
        assert all(rejoined[s] == survivor_hashes[s] for s in after_rejoin), rank
    return survivor


@pytest.mark.slow
def test_a_killed_group_rejoins_bitwise_and_the_survivor_loses_no_step(tmp_path, plain_four_processes):
    """Group 1 is SIGKILLed between steps (after step 4), restarted, then SIGKILLed inside its cross-group
    all-reduce (at step 8, or its first step after rejoining) and restarted again; group 0 runs throughout, alone
    while group 1 is away, except that from step 10 on it waits for it (--hold: the restarts rejoin before the
    end of a short run, whatever the machine's speed)."""
    steps, kills = 16, ("1:4:between", "1:8:allreduce")
    checkpoints = ("--checkpoint.enable", "--checkpoint.interval", "8")
    events = launch(tmp_path, steps, *checkpoints, kills=kills, hold="0:10", restart=2)
    survivor = check_failures(tmp_path, events, steps, kills)
    uncommitted = {m["step"]: m["fault_tolerance/uncommitted_steps"] for m in survivor}
    live = {m["step"]: m[LIVE_GROUPS] for m in survivor}
    # Killed between steps: the survivor goes on alone with no step uncommitted ...
    assert live[5] == 1 and uncommitted[5] == 0
    # ... killed mid-all-reduce: at most the step in flight is not committed (then retried on the same rows).
    assert uncommitted[steps] <= 1 and live[steps] == 2
    # With both groups live (steps 1..4): the plain 4-process run's losses, within fp32 rounding.
    reference = plain_four_processes[:4]
    assert all(m[LIVE_GROUPS] == 2 for m in survivor[:4])
    loss = "loss_metrics/global_avg_loss"
    assert max_rel_diff([m[loss] for m in survivor[:4]], [m[loss] for m in reference]) <= EAGER_RTOL
    assert max_rel_diff([m["grad_norm"] for m in survivor[:4]], [m["grad_norm"] for m in reference]) \
        <= SHARDED_NORM_RTOL
    # Beside it, checkpoints: one group wrote them into the shared folder (the last at the last step) ...
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == ["step-16", "step-8"]
    # ... and when every group has died, a relaunch of all resumes there and the groups agree from the first step.
    launch(tmp_path, steps + 2, *checkpoints)
    for group in (0, 1):
        assert [m["step"] for m in read_metrics(tmp_path / f"replica_{group}")][-2:] == [17, 18]
        log = (tmp_path / f"replica_{group}" / "launch_0.log").read_text()  # the relaunch's (it replaced the first)
        assert "step-16 (step 16" in log and "healed" not in log  # each group loaded it; none healed instead
    for rank in (0, 1):
        assert hashes(tmp_path, 0, rank)[18] == hashes(tmp_path, 1, rank)[18]


@pytest.mark.slow
def test_compiled_groups_match_the_plain_run_and_rejoin_bitwise(tmp_path, plain_four_processes):
    """The same with Inductor, killed mid-all-reduce at step 5: the restarted group's graphs come from the shared
    compile cache; the survivor goes on alone, from step 7 waiting for it."""
    steps, kills = 10, ("1:4:allreduce",)
    cache = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    events = launch(tmp_path, steps, "--compile.enable", "--compile.cache_dir", str(tmp_path / "compile_cache"),
                    kills=kills, hold="0:6", restart=1, env=cache)
    survivor = check_failures(tmp_path, events, steps, kills)
    assert survivor[-1]["fault_tolerance/uncommitted_steps"] <= 1
    assert survivor[5][LIVE_GROUPS] == 1  # step 6: alone
    loss = "loss_metrics/global_avg_loss"
    assert all(m[LIVE_GROUPS] == 2 for m in survivor[:4])
    assert max_rel_diff([m[loss] for m in survivor[:4]], [m[loss] for m in plain_four_processes[:4]]) \
        <= COMPILED_RTOL


@pytest.mark.slow
def test_muon_under_replica_groups_matches_the_plain_run(tmp_path):
    """Muon (float32 Newton-Schulz) in two replica groups of two: the cross-group gradient average comes before the
    update, each group orthogonalizes its matrices on its own owners: the plain 4-process Muon run's losses and
    gradient norms, and both groups' parameter and optimizer shards bitwise equal at every step."""
    muon = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
    train_py(*TINY, *muon, "--training.steps", "4", "--job.dump_folder", tmp_path / "plain", nproc=4)
    reference = read_metrics(tmp_path / "plain")
    launch(tmp_path / "ft", 4, *muon)
    grouped = read_metrics(tmp_path / "ft" / "replica_0")
    assert [m["step"] for m in grouped] == [m["step"] for m in reference] == [1, 2, 3, 4]
    assert all(m[LIVE_GROUPS] == 2 for m in grouped)
    loss = "loss_metrics/global_avg_loss"
    assert max_rel_diff([m[loss] for m in grouped], [m[loss] for m in reference]) <= EAGER_RTOL
    assert max_rel_diff([m["grad_norm"] for m in grouped], [m["grad_norm"] for m in reference]) <= SHARDED_NORM_RTOL
    for rank in (0, 1):
        assert sorted(hashes(tmp_path / "ft", 0, rank)) == [1, 2, 3, 4]
        assert hashes(tmp_path / "ft", 0, rank) == hashes(tmp_path / "ft", 1, rank)


def test_fault_tolerance_off_builds_no_replica_groups(tmp_path):
    """The default job's step never reaches torchft: no manager, the plain step (losses bitwise as before)."""
    from titan_simple.trainer.trainer import Trainer

    config = load_job_config([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(config)
    assert trainer.loop_features == [] and trainer.run.step.features == ()
    assert trainer.log_folder == str(tmp_path)
