"""Profiling: trace files per rank at the documented paths, CPU memory timelines, and the CUDA memory-snapshot
path exercised against faked (signature-checked) private CUDA functions."""

from __future__ import annotations

import inspect
import json
import pickle
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed_utils import run_on_ranks
from tests.harness import DEBUG, SMALL, run_python, train_py
from titan_simple.config import Profiling, load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.trainer import torch_private
from titan_simple.trainer.profiling import Profiler
from titan_simple.trainer.trainer import Trainer


def read_trace(path: Path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    assert events, path
    return events


# ------------------------------------------------------------------------------------------- private API


def test_the_private_cuda_memory_functions_we_wrap_still_exist():
    """trainer/torch_private.py calls these private functions with these arguments; a torch upgrade that renames them or
    their parameters must fail here, not in the middle of a GPU run."""
    record = inspect.signature(torch.cuda.memory._record_memory_history)
    record.bind(enabled="all", max_entries=torch_private.MAX_MEMORY_EVENTS)
    record.bind(enabled=None)
    inspect.signature(torch.cuda.memory._dump_snapshot).bind("snapshot.pickle")
    assert hasattr(torch, "OutOfMemoryError") and issubclass(torch.OutOfMemoryError, RuntimeError)


class FakeCudaMemory:
    """Stands in for torch.cuda.memory's recorder: checks each call against the real function's signature and
    writes a pickle like _dump_snapshot does."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.real_record = inspect.signature(torch.cuda.memory._record_memory_history)
        self.real_dump = inspect.signature(torch.cuda.memory._dump_snapshot)

    def record(self, *args, **kwargs) -> None:
        bound = self.real_record.bind(*args, **kwargs)
        self.calls.append(("record", bound.arguments.get("enabled"), bound.arguments.get("max_entries")))

    def dump(self, *args, **kwargs) -> None:
        filename = self.real_dump.bind(*args, **kwargs).arguments["filename"]
        self.calls.append(("dump", filename))
        with open(filename, "wb") as f:
            pickle.dump({"segments": [], "device_traces": []}, f)


def test_cuda_memory_snapshots_every_profile_freq_steps_and_on_oom(tmp_path, monkeypatch):
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch_private, "_record_memory_history", fake.record)  # the guarded module's names
    monkeypatch.setattr(torch_private, "_dump_snapshot", fake.dump)
    config = Profiling(enable_memory_snapshot=True, profile_freq=2, profiler_warmup=0, profiler_active=1)
    profiler = Profiler(config, str(tmp_path), rank=3, device=torch.device("cuda", 3))
    profiler.start()
    for step in range(1, 5):
        with profiler.dump_on_oom(step):
            pass
        profiler.step(step)
    with pytest.raises(torch.OutOfMemoryError, match="fake"), profiler.dump_on_oom(5):
        raise torch.OutOfMemoryError("fake: tried to allocate 80 GiB")
    with pytest.raises(ValueError), profiler.dump_on_oom(6):  # other errors pass through without a dump
        raise ValueError("not memory")
    profiler.stop()
    profiler.stop()  # a second stop (trainer's finally after an error) does nothing

    snapshots = tmp_path / "memory_snapshot"
    assert fake.calls == [
        ("record", "all", 100_000),
        ("dump", str(snapshots / "iteration_2" / "rank3_memory_snapshot.pickle")),
        ("dump", str(snapshots / "iteration_4" / "rank3_memory_snapshot.pickle")),
        ("dump", str(snapshots / "iteration_5_oom" / "rank3_memory_snapshot.pickle")),
        ("record", None, None),
    ]
    dumped = sorted(p.parent.name for p in snapshots.rglob("*.pickle"))
    assert dumped == ["iteration_2", "iteration_4", "iteration_5_oom"]
    assert not (tmp_path / "profile_traces").exists()  # no torch.profiler without enable_profiling


def test_nothing_enabled_touches_nothing(tmp_path):
    profiler = Profiler(Profiling(), str(tmp_path), rank=0, device=torch.device("cpu"))
    profiler.start()
    profiler.step(10)
    profiler.stop()
    assert not profiler.enabled and not any(tmp_path.iterdir())


def test_profiling_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"\[profiling\] profile_freq = 3 is impossible; expected >= "
                                          r"profiler_warmup \+ profiler_active = 4"):
        load_job_config(["--profiling.profile_freq", "3", "--profiling.profiler_warmup", "3"])


# ------------------------------------------------------------------------------------------- traces


def test_trainer_writes_a_trace_and_a_cpu_memory_timeline(tmp_path, caplog):
    config = load_job_config([
        *SMALL, "--training.steps", "2", "--job.dump_folder", str(tmp_path), "--profiling.enable_profiling",
        "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1", "--profiling.enable_memory_snapshot",
    ])
    with caplog.at_level("INFO", logger="titan_simple"):
        Trainer(config).train()

    (trace,) = (tmp_path / "profile_traces").rglob("*.json")
    assert trace == tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json"
    names = {event.get("name") for event in read_trace(trace)}
    # The recorded step (the profiler counts from 0) with our model's ops, forward, backward and optimizer:
    assert {"ProfilerStep#1", "aten::embedding", "aten::scaled_dot_product_attention", "aten::silu",
            "aten::logsumexp", "aten::embedding_dense_backward", "aten::_foreach_addcdiv_"} <= names  # chunked loss

    timeline = tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory_timeline.json"
    times, sizes = json.loads(timeline.read_text())
    assert len(times) == len(sizes) > 10 and times == sorted(times)
    parameter_bytes = 5_745_920 * 4  # debugmodel, fp32
    assert max(s[1] for s in sizes) == pytest.approx(parameter_bytes, rel=0.01)  # category 1: parameters
    assert max(s[2] for s in sizes) == pytest.approx(2 * parameter_bytes, rel=0.01)  # AdamW's two moments
    assert any("no CUDA here, so no allocator snapshot" in r.getMessage() for r in caplog.records)


def _profile_a_toy_model(rank: int, world_size: int, dump: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    config = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=2)
    profiler = Profiler(config, dump, rank=rank, device=torch.device("cpu"))
    profiler.start()
    for step in range(1, 7):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        torch.distributed.all_reduce(loss.detach())
        profiler.step(step)
    profiler.stop()


@pytest.mark.slow
def test_each_rank_writes_its_trace_every_profile_freq_steps(tmp_path):
    run_on_ranks(_profile_a_toy_model, 2, args=(str(tmp_path),))
    expected = [f"profile_traces/iteration_{n}/rank{r}_trace.json" for n in (3, 6) for r in (0, 1)]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json")) == expected
    for relative in expected:
        names = {event.get("name") for event in read_trace(tmp_path / relative)}
        # 2 active steps per recording (profiler steps 1-2 and 4-5), with the layers and the collective:
        assert {"aten::addmm", "aten::gelu", "gloo:all_reduce"} <= names, relative
        assert len({n for n in names if n and n.startswith("ProfilerStep#")}) == 2


# ------------------------------------------------------------------------------- CPU memory timeline, several ranks

MEMORY_SNAPSHOT_ON_CPU = r"\[profiling\] enable_memory_snapshot on CPU needs one process, not 2: torch 2\.13's"


def test_a_cpu_memory_timeline_on_several_processes_is_refused_by_the_plan():
    config = load_job_config(["--config", "llama3_debug.toml", "--profiling.enable_profiling",
                              "--profiling.enable_memory_snapshot"])
    with pytest.raises(ConfigError, match=MEMORY_SNAPSHOT_ON_CPU + r".*\(python train\.py \.\.\.\).*--dry_run"):
        resolve_plan(config, 2, "cpu")
    resolve_plan(config, 1, "cpu")  # one process: the timeline works (test_trainer_writes_a_trace_and_...)
    resolve_plan(config, 8, "cuda")  # GPUs: allocator snapshots, any layout


def _freed_on(thread: str) -> list[int]:
    """The profiler's memory events (bytes) of a tensor allocated here and freed on ``thread``."""
    numel = 12_345  # a size nothing else allocates
    keep = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        keep.append(torch.empty(numel))
        if thread == "main":
            keep.clear()
        else:
            worker = threading.Thread(target=keep.clear)
            worker.start()
            worker.join()
    return [e.cpu_memory_usage for e in profiler.events() if abs(e.cpu_memory_usage) == numel * 4]


def test_torch_still_misses_frees_made_on_other_threads():
    """The root cause of the refusal above: a free on a thread without the profiler's state is not recorded,
    and gloo's worker threads free the tensors their collectives hold. When this fails, torch records such
    frees: try the README's 2-process memory timeline and lift ``check_profiling``'s refusal (core/plan.py)."""
    assert _freed_on("main") == [49_380, -49_380]
    assert _freed_on("another thread") == [49_380]  # the free is lost


@pytest.mark.slow
def test_cpu_memory_timeline_on_two_processes_is_refused_in_one_line_at_start(tmp_path):
    """The README's command, as a new user runs it: one line from rank 0, exit status 2 from the ranks, before
    any data, model or profiler work."""
    result = train_py(*DEBUG, "--profiling.enable_profiling", "--profiling.profile_freq", "10",
                      "--profiling.enable_memory_snapshot", "--job.dump_folder", tmp_path, nproc=2, timeout=120,
                      expect=None, launch=True)  # torchrun's report of the ranks' status is asserted
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match("error: " + MEMORY_SNAPSHOT_ON_CPU, errors[0]), result.stderr
    assert "exitcode  : 2" in result.stderr  # the one-line ConfigError status, not a crash
    assert not any(tmp_path.iterdir())  # refused before anything was written


FAILING_EXPORT = """
import torch
from titan_simple.config import Profiling
from titan_simple.trainer.profiling import Profiler

def disk_full(self, path):
    raise OSError(28, "No space left on device", path)

torch.profiler.profile.export_chrome_trace = disk_full
# wait = profile_freq - warmup - active = 0: the next cycle's warm-up starts in the same transition as the export
config = Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
profiler = Profiler(config, {dump!r}, rank=0, device=torch.device("cpu"))
profiler.start()
x = torch.randn(32, 32, requires_grad=True)
try:
    for step in range(1, 5):
        (x @ x).sum().backward()
        profiler.step(step)
except OSError as error:
    print(f"raised at step {{step}}: {{error}}", flush=True)
finally:
    profiler.stop()
print("stopped cleanly", flush=True)
"""


def test_a_failed_export_is_raised_from_step_and_the_profiler_still_stops(tmp_path):
    """torch's profiler dies of SIGSEGV on stop() when on_trace_ready raised while the next cycle began; the
    error must come out of Profiler.step instead, and stop() must work (a subprocess: a regression segfaults)."""
    result = run_python("-c", FAILING_EXPORT.format(dump=str(tmp_path)), timeout=120)
    assert "raised at step 2: [Errno 28] No space left on device" in result.stdout
    assert "stopped cleanly" in result.stdout
