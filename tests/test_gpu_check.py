"""scripts/gpu_check.py: the CPU run passes every row it can and says why it skips the GPU-only ones; a failing row
exits non-zero while the other rows still run; the GPU branches' decisions, driven with fake inputs (no GPU has run
them: these tests check what the script decides from what CUDA would report, not that CUDA reports it)."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import REPO, load_script, run_python
from titan_simple.core.device_peaks import peak_tflops_for_device_name
from titan_simple.trainer.distributed import DistInfo, init_process_group
from titan_simple.trainer.metrics import (
    CUDA_MAX_ACTIVE_GIB,
    CUDA_MAX_ACTIVE_PERCENT,
    CUDA_MAX_RESERVED_GIB,
    CUDA_MAX_RESERVED_PERCENT,
    CUDA_NUM_ALLOC_RETRIES,
    CUDA_NUM_OOMS,
    MFU,
    PEAK_RSS_GIB,
    TFLOPS,
)

SCRIPT = REPO / "scripts" / "gpu_check.py"
gpu_check = load_script(SCRIPT)


# ------------------------------------------------------------------------------------------ the table


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python scripts/gpu_check.py ...`` as a user runs it (in this process's environment)."""
    return run_python(SCRIPT, *args, env={**os.environ, **(env or {})}, timeout=1500, expect=None)


def table_rows(stdout: str) -> dict[str, tuple[str, float, str]]:
    """capability title -> (result, seconds, what to do / why) from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split(" | ", 3)]
        if len(cells) == 4 and cells[1] in ("pass", "fail", "skipped"):
            rows[cells[0]] = (cells[1], float(cells[2]), cells[3])
    return rows


TITLES = {row.name: row.title for row in gpu_check.ROWS}


@pytest.mark.slow
def test_cpu_run_passes_every_cpu_row_with_numbers_and_skips_the_gpu_rows_with_a_reason():
    done = run_script()
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    rows = table_rows(done.stdout)
    assert list(rows) == [row.title for row in gpu_check.ROWS], done.stdout
    for name in ("process_group", "compile", "memory", "checkpoint", "trace"):
        result, _, detail = rows[TITLES[name]]
        assert result == "pass" and re.search(r"\d", detail), (name, detail)
    assert "gloo, 2 ranks" in rows[TITLES["process_group"]][2]
    assert "limit 1e-05" in rows[TITLES["compile"]][2] and "4 all-gathers for 4 buckets" in rows[TITLES["compile"]][2]
    assert rows[TITLES["mfu"]][0] == "skipped" and "not defined on CPU" in rows[TITLES["mfu"]][2]
    assert rows[TITLES["async_tp"]][0] == "skipped" and "needs CUDA + NCCL" in rows[TITLES["async_tp"]][2]
    assert "kept in" not in done.stdout  # the temporary folder is gone


@pytest.mark.slow
def test_a_failing_row_exits_non_zero_and_the_other_rows_still_run():
    """memory raises on rank 0, rank 0 dies silently during checkpoint: both fail with their reason, each ends its
    job, and the rows around them still pass in the next jobs."""
    done = run_script("--only", "process_group,memory,checkpoint,trace",
                      env={gpu_check.INJECT_VARIABLE: "memory,checkpoint:crash"})
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert rows[TITLES["process_group"]][0] == "pass"
    assert rows[TITLES["memory"]][0] == "fail" and "injected failure" in rows[TITLES["memory"]][2]
    assert rows[TITLES["checkpoint"]][0] == "fail"
    assert "rank 0 died during this row" in rows[TITLES["checkpoint"]][2]
    assert rows[TITLES["trace"]][0] == "pass", done.stdout
    assert "2 checks failed: memory, checkpoint" in done.stdout
    kept = re.search(r"kept in (\S+)", done.stdout).group(1)  # a failure keeps the logs
    assert sorted(p.name for p in Path(kept).glob("job-*.log")) == ["job-1.log", "job-2.log", "job-3.log"]
    shutil.rmtree(kept)


def test_an_unknown_row_is_one_line_and_status_2(capsys):
    assert gpu_check.main(["--only", "memory,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --only nope: no such check; choose from process_group, compile, memory, mfu, async_tp, checkpoint, "
        "trace")


# ------------------------------------------------------------------------------ the jobs, with fake ranks


def fake_job(rows: list[str], ends: dict[str, str], crash_in: str | None = None, exit_code: int | None = 0,
             nproc: int = 2) -> gpu_check.JobEnd:
    """What the ranks of a job would have recorded: each row of ``rows`` started and ended with ``ends[row]`` (pass
    by default) on every rank, until the first failing one; rank 1 dies in ``crash_in`` without a record."""
    records: dict[int, list[dict]] = {rank: [] for rank in range(nproc)}
    for name in rows:
        for rank in range(nproc):
            records[rank].append({"row": name, "event": "start"})
            if name == crash_in and rank == 1:
                continue
            status = ends.get(name, "pass")
            records[rank].append({"row": name, "event": "end", "status": status, "seconds": 1.0,
                                  "detail": f"{status} detail {rank}"})
        if name == crash_in or ends.get(name) == "fail":
            break
    return gpu_check.JobEnd(exit_code, records, Path("/nonexistent/job.log"), 900.0)


def test_rows_after_a_failure_run_in_a_new_job(monkeypatch):
    jobs = []

    def launch(index, rows, nproc, folder, timeout_s):
        jobs.append(list(rows))
        return fake_job(rows, {"memory": "fail"}, crash_in="checkpoint" if index == 2 else None,
                        exit_code=0 if index == 3 else 1)

    monkeypatch.setattr(gpu_check, "launch_job", launch)
    results = gpu_check.run_rows(list(gpu_check.ROW_NAMES), 2, Path("/tmp"), 900.0)
    assert jobs == [list(gpu_check.ROW_NAMES), ["mfu", "async_tp", "checkpoint", "trace"], ["trace"]]
    assert {name: r.status for name, r in results.items()} == {
        "process_group": "pass", "compile": "pass", "memory": "fail", "mfu": "pass", "async_tp": "pass",
        "checkpoint": "fail", "trace": "pass"}
    assert results["memory"].detail == "rank 0: fail detail 0"
    assert results["checkpoint"].detail.startswith("rank 1 died during this row (job exit code 1)")


def test_the_rank_that_failed_first_is_named():
    job = fake_job(["checkpoint"], {"checkpoint": "fail"})
    job.records[0][-1]["time"], job.records[1][-1]["time"] = 20.0, 10.0  # rank 0 only saw rank 1 leave
    results, _ = gpu_check.merge_job(["checkpoint"], job, 2)
    assert results["checkpoint"].detail == "rank 1: fail detail 1"


def test_a_rank_that_died_silently_is_named_before_one_that_saw_it_leave():
    """Rank 1 dies in the row; rank 0's collective then fails with "Connection closed by peer" and says so first
    (with one gloo worker thread it does: the suite once named rank 0 here)."""
    job = fake_job(["checkpoint"], {"checkpoint": "fail"}, crash_in="checkpoint", exit_code=1)
    job.records[0][-1]["detail"] = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    results, _ = gpu_check.merge_job(["checkpoint"], job, 2)
    assert results["checkpoint"].detail.startswith("rank 1 died during this row (job exit code 1)")
    job.records[0][-1]["detail"] = "injected failure"  # a rank's own error is named, the rank killed after it not
    results, _ = gpu_check.merge_job(["checkpoint"], job, 2)
    assert results["checkpoint"].detail == "rank 0: injected failure"


def test_a_failed_process_group_skips_the_rest(monkeypatch):
    monkeypatch.setattr(gpu_check, "launch_job",
                        lambda index, rows, *_: fake_job(rows, {"process_group": "fail"}, exit_code=1))
    results = gpu_check.run_rows(["process_group", "compile", "trace"], 2, Path("/tmp"), 900.0)
    assert [r.status for r in results.values()] == ["fail", "skipped", "skipped"]
    assert results["trace"].detail == "needs the process group (failed above)"


def test_a_hung_job_names_the_row_it_hung_in():
    job = fake_job(["process_group", "compile"], {}, crash_in="compile", exit_code=None)
    results, remaining = gpu_check.merge_job(["process_group", "compile", "memory"], job, 2)
    assert results["process_group"].status == "pass" and remaining == ["memory"]
    assert results["compile"].status == "fail"
    assert results["compile"].detail.startswith("no result after 900 s (ranks [1] hung, maybe in a collective)")
    assert "NCCL_SOCKET_IFNAME" in results["compile"].detail


def test_the_table_has_one_line_per_row_in_order():
    results = {"trace": gpu_check.RowResult("pass", 1.25, "one trace per rank"),
               "process_group": gpu_check.RowResult("fail", 0.5, "NCCL failed")}
    lines = gpu_check.format_table(results).splitlines()
    assert lines[0].split(" | ") == ["capability                ", "result", "seconds", "what to do / why"]
    assert lines[2] == "process group + all-reduce | fail   |     0.5 | NCCL failed"
    assert lines[3] == "profiler trace             | pass   |     1.2 | one trace per rank"


# ---------------------------------------------------------------- the GPU branches' decisions, fake inputs


def test_processes_default_to_every_gpu_or_two_on_cpu():
    assert gpu_check.default_nproc("cuda", 8) == 8
    assert gpu_check.default_nproc("cpu", 0) == 2
    assert gpu_check.backend_for("cuda") == "nccl" and gpu_check.backend_for("cpu") == "gloo"


def test_the_trainer_binds_each_rank_to_its_gpu_with_arguments_torch_accepts(monkeypatch):
    """What trainer/distributed.py (the path gpu_check's first row runs) does on CUDA, with torch's functions
    recorded instead of called; the arguments must bind to torch 2.13's real init_process_group signature."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.setdefault("init", kwargs))
    init_process_group(DistInfo(rank=3, world_size=8, local_rank=3, device=torch.device("cuda", 3)))
    assert calls["set_device"] == torch.device("cuda", 3)
    assert calls["init"]["backend"] == "nccl" and calls["init"]["device_id"] == torch.device("cuda", 3)
    monkeypatch.undo()
    inspect.signature(dist.init_process_group).bind(**calls["init"])


def test_symmetric_memory_probe_calls_fit_torch():
    """The probe's calls (torch_private.probe_symmetric_memory) bind to torch 2.13's signatures; running them
    needs GPUs."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    inspect.signature(symmetric_memory.empty).bind(64, dtype=torch.uint8, device=torch.device("cuda", 0))
    inspect.signature(symmetric_memory.rendezvous).bind(torch.empty(1), "group")


def test_async_tp_needs_cuda_nccl_and_an_even_number_of_gpus():
    assert "needs CUDA + NCCL" in gpu_check.async_tp_skip_reason("cpu", "gloo", 2)
    assert "even number of GPUs" in gpu_check.async_tp_skip_reason("cuda", "nccl", 1)
    assert "not 3" in gpu_check.async_tp_skip_reason("cuda", "nccl", 3)
    assert gpu_check.async_tp_skip_reason("cuda", "nccl", 8) is None


def test_fused_ops_are_counted_from_profile_event_names():
    names = ["aten::mm", "symm_mem::fused_all_gather_matmul", "symm_mem::fused_all_gather_matmul",
             "symm_mem::fused_matmul_reduce_scatter", "nccl:all_gather"]
    assert gpu_check.fused_async_tp_ops(names) == {"symm_mem::fused_all_gather_matmul": 2,
                                                   "symm_mem::fused_matmul_reduce_scatter": 1}


def test_compiled_against_eager_tolerances_are_bf16_on_gpus_and_fp32_on_cpu():
    eager = [(7.6, 2.0), (7.5, 1.9)]
    slightly_off = [(7.6 * (1 + 2e-5), 2.0), (7.5, 1.9)]
    with pytest.raises(gpu_check.CheckFailed, match="losses by 2.0e-05 \\(limit 1e-05\\)"):
        gpu_check.compare_runs("cpu", {"compiled": slightly_off, "eager": eager}, "compiled", "eager")
    bf16_rounding = [(7.6 * (1 + 1e-2), 2.0 * (1 - 1e-2)), (7.5, 1.9)]
    assert "limit 2e-02" in gpu_check.compare_runs("cuda", {"compiled": bf16_rounding, "eager": eager}, "compiled",
                                                    "eager")
    wrong_scale = [(7.6, 4.0), (7.5, 3.8)]
    with pytest.raises(gpu_check.CheckFailed, match="grad norms by 1.0e\\+00"):
        gpu_check.compare_runs("cuda", {"compiled": wrong_scale, "eager": eager}, "compiled", "eager")


def cuda_memory_metrics(active: float, reserved: float) -> dict[str, float]:
    """What MemoryMonitor.read() returns on CUDA (trainer/metrics.py, _read_cuda), for an 80 GiB GPU."""
    return {CUDA_MAX_ACTIVE_GIB: active, CUDA_MAX_ACTIVE_PERCENT: 100 * active / 80,
            CUDA_MAX_RESERVED_GIB: reserved, CUDA_MAX_RESERVED_PERCENT: 100 * reserved / 80,
            CUDA_NUM_ALLOC_RETRIES: 0.0, CUDA_NUM_OOMS: 0.0}


def test_memory_row_reports_the_cuda_allocator_peaks_and_rejects_nonsense():
    outcome = gpu_check.memory_outcome("cuda", cuda_memory_metrics(0.25, 0.5))
    assert outcome.status == "pass"
    assert outcome.detail.startswith("max reserved 0.50 GiB (0.6% of the GPU), max active 0.25 GiB, 0 alloc retries")
    with pytest.raises(gpu_check.CheckFailed, match="peaks make no sense"):
        gpu_check.memory_outcome("cuda", cuda_memory_metrics(0.6, 0.5))
    with pytest.raises(gpu_check.CheckFailed):
        gpu_check.memory_outcome("cuda", cuda_memory_metrics(0.0, 0.0))
    assert gpu_check.memory_outcome("cpu", {PEAK_RSS_GIB: 0.7}).detail.startswith("memory/peak_rss(GiB) 0.70")


def test_mfu_row_uses_the_peak_table_of_the_gpu_it_finds():
    name = "NVIDIA H100 80GB HBM3"
    peak = peak_tflops_for_device_name(name) * 1e12
    outcome = gpu_check.mfu_outcome("cuda", name, peak, {TFLOPS: 4.945, MFU: 0.5})
    assert outcome.status == "pass" and outcome.detail.startswith("mfu 0.50% of NVIDIA H100 80GB HBM3's 989 TFLOP/s")
    unknown = gpu_check.mfu_outcome("cuda", "NVIDIA GeForce RTX 4090", None, {TFLOPS: 1.0})
    assert unknown.status == "skipped" and "add its dense BF16 TFLOP/s to PEAK_BF16_TFLOPS" in unknown.detail
    with pytest.raises(gpu_check.CheckFailed, match="MFU 150.0 % is impossible"):
        gpu_check.mfu_outcome("cuda", name, peak, {TFLOPS: 1483.5, MFU: 150.0})
    assert gpu_check.mfu_outcome("cpu", "cpu", None, {TFLOPS: 0.002}).status == "skipped"


def test_a_cuda_trace_without_gpu_kernels_is_a_failure():
    step = {"name": "ProfilerStep#3", "cat": "user_annotation"}
    collective = {"name": "nccl:all_gather_into_tensor_coalesced", "cat": "cpu_op"}
    kernel = {"name": "ncclDevKernel_AllGather_RING_LL", "cat": "kernel"}
    assert gpu_check.trace_problems({"traceEvents": [step, collective, kernel]}, "cuda", 8) == []
    problems = gpu_check.trace_problems({"traceEvents": [step, collective]}, "cuda", 8)
    assert len(problems) == 1 and problems[0].startswith("no GPU kernel: CUPTI recorded nothing")
    assert gpu_check.trace_problems({"traceEvents": [step]}, "cpu", 2) == ["no collective"]


def test_nccl_and_gpu_memory_errors_get_their_own_advice():
    row = gpu_check.ROWS_BY_NAME["compile"]
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error\nmore")
    assert gpu_check.error_line(nccl) == ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
                                          "system error")
    assert gpu_check.advice(row, nccl, "cuda").startswith("NCCL failed: check NCCL_SOCKET_IFNAME")
    init = gpu_check.advice(gpu_check.ROWS_BY_NAME["process_group"], nccl, "cuda")
    assert init.startswith("NCCL init failed: check NCCL_SOCKET_IFNAME") and "NCCL_DEBUG=INFO" in init
    assert "nvidia-smi" in gpu_check.advice(row, torch.OutOfMemoryError("CUDA out of memory"), "cuda")
    assert gpu_check.advice(row, ValueError("x"), "cuda") == row.todo


def test_the_log_line_named_for_a_dead_rank_is_its_error_not_torchruns_summary(tmp_path):
    log = tmp_path / "job-1.log"
    log.write_text("[rank1] ... RuntimeError: CUDA error: an illegal memory access was encountered\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  exitcode  : 1\n"
                   "  traceback : Signal 15 (SIGTERM) received by PID 30767\n")
    assert gpu_check.last_error_line(log) == "[rank1] ... RuntimeError: CUDA error: an illegal memory access was " \
                                             "encountered"


def test_injected_failures_are_read_from_the_test_variable():
    assert gpu_check.injected_failures(None) == {}
    assert gpu_check.injected_failures("memory, checkpoint:crash") == {"memory": "raise", "checkpoint": "crash"}
