"""Metrics: peak-FLOPs table, throughput/MFU/ETA, memory monitor (CPU and a faked CUDA), loss reduction,
and the console / JSONL / TensorBoard logger read back from disk."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.distributed_utils import single_rank_process_group
from tests.harness import read_metrics
from titan_simple.core.device_peaks import PEAK_BF16_TFLOPS, peak_flops_per_second, peak_tflops_for_device_name
from titan_simple.trainer import metrics as metrics_module
from titan_simple.trainer.metrics import (
    AVG_LOSS,
    CUDA_MAX_ACTIVE_GIB,
    CUDA_MAX_ACTIVE_PERCENT,
    CUDA_MAX_RESERVED_GIB,
    CUDA_MAX_RESERVED_PERCENT,
    CUDA_NUM_ALLOC_RETRIES,
    CUDA_NUM_OOMS,
    DATA_LOADING_PERCENT,
    DATA_LOADING_SECONDS,
    END_TO_END_SECONDS,
    GRAD_NORM,
    LR,
    MAX_LOSS,
    MFU,
    PEAK_RSS_GIB,
    PEAK_RSS_SINCE_START_GIB,
    TFLOPS,
    TOKENS_PER_SECOND,
    MemoryMonitor,
    MetricsLogger,
    StepTimer,
    compute_throughput,
    eta_seconds,
    global_avg_and_max,
)

GIB = 1024**3

# ------------------------------------------------------------------------------------------- peak table


@pytest.mark.parametrize(
    "device_name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA H20", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_lookup_by_device_name(device_name, tflops):
    assert peak_tflops_for_device_name(device_name) == tflops


def test_peak_flops_none_on_cpu_and_from_the_cuda_device_name(monkeypatch):
    assert peak_flops_per_second(torch.device("cpu")) is None
    asked = []
    pcie = "NVIDIA H100 PCIe"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: asked.append(device) or pcie)
    assert peak_flops_per_second(torch.device("cuda", 3)) == 756e12
    assert asked == [torch.device("cuda", 3)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peak_flops_per_second(torch.device("cuda", 0)) is None
    assert PEAK_BF16_TFLOPS["H100 SXM"] == 989.0


# ------------------------------------------------------------------------------------------- throughput


def test_throughput_tflops_and_mfu_arithmetic():
    result = compute_throughput(tokens=1000, elapsed_seconds=2.0, flops_per_token=6e9, peak_flops=10e12)
    assert result.tokens_per_second == 500.0
    assert result.tflops == pytest.approx(3.0)  # 500 tok/s x 6 GFLOP/tok
    assert result.mfu_percent == pytest.approx(30.0)
    assert compute_throughput(1000, 2.0, 6e9, None).mfu_percent is None


def test_eta_from_average_step_time():
    assert eta_seconds(steps_done=10, steps_left=90, elapsed_seconds=20.0) == 180.0
    assert eta_seconds(steps_done=100, steps_left=0, elapsed_seconds=20.0) == 0.0
    # Resumed at step 20 of 25, 5 steps done here in 10 s: nothing left (counting from the steps done here said 40 s).
    assert eta_seconds(steps_done=5, steps_left=25 - 25, elapsed_seconds=10.0) == 0.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_window_metrics_and_eta():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    for _ in range(4):
        with timer.data_loading():
            clock.now += 0.5
        clock.now += 1.5
        timer.step_done(tokens=2048)
    window = timer.window_metrics(flops_per_token=1e9, peak_flops=4e12)
    assert window[TOKENS_PER_SECOND] == pytest.approx(4 * 2048 / 8.0)
    assert window[TFLOPS] == pytest.approx(1024 * 1e9 / 1e12)
    assert window[MFU] == pytest.approx(100 * 1.024 / 4)
    assert window[END_TO_END_SECONDS] == pytest.approx(2.0)
    assert window[DATA_LOADING_SECONDS] == pytest.approx(0.5)
    assert window[DATA_LOADING_PERCENT] == pytest.approx(25.0)
    assert timer.eta_seconds(steps_left=6) == pytest.approx(6 * 2.0)
    clock.now += 1.0
    timer.step_done(tokens=10)
    second = timer.window_metrics(flops_per_token=1e9, peak_flops=None)  # a fresh window
    assert second[TOKENS_PER_SECOND] == pytest.approx(10.0) and MFU not in second
    assert second[DATA_LOADING_PERCENT] == 0.0


# ------------------------------------------------------------------------------------------- memory


def test_cpu_memory_monitor_reports_a_positive_peak_rss():
    monitor = MemoryMonitor(torch.device("cpu"))
    monitor.reset_peak()
    block = torch.ones(64, 1024, 1024, dtype=torch.uint8)  # 64 MiB touched
    reading = monitor.read()
    del block
    (key,) = reading
    assert key in (PEAK_RSS_GIB, PEAK_RSS_SINCE_START_GIB)
    assert reading[key] > 64 / 1024


def test_cpu_memory_monitor_names_the_since_start_fallback(monkeypatch):
    monkeypatch.setattr(metrics_module, "_reset_vm_hwm", lambda: False)
    monitor = MemoryMonitor(torch.device("cpu"))
    monitor.reset_peak()
    reading = monitor.read()
    assert list(reading) == [PEAK_RSS_SINCE_START_GIB] and reading[PEAK_RSS_SINCE_START_GIB] > 0


def test_cuda_memory_monitor_arithmetic_with_a_faked_cuda_api(monkeypatch):
    calls = []
    stats = {
        "active_bytes.all.peak": 20 * GIB,
        "reserved_bytes.all.peak": 30 * GIB,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }

    def memory_stats(device):
        calls.append(("memory_stats", device))
        return stats

    def get_device_properties(device):
        calls.append(("get_device_properties", device))
        return SimpleNamespace(total_memory=80 * GIB)

    def reset_peak_memory_stats(device):
        calls.append(("reset_peak_memory_stats", device))

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    device = torch.device("cuda", 1)
    monitor = MemoryMonitor(device)
    monitor.reset_peak()
    assert monitor.read() == {
        CUDA_MAX_ACTIVE_GIB: 20.0,
        CUDA_MAX_ACTIVE_PERCENT: 25.0,
        CUDA_MAX_RESERVED_GIB: 30.0,
        CUDA_MAX_RESERVED_PERCENT: 37.5,
        CUDA_NUM_ALLOC_RETRIES: 2.0,
        CUDA_NUM_OOMS: 1.0,
    }
    assert calls == [
        ("get_device_properties", device), ("reset_peak_memory_stats", device), ("memory_stats", device)
    ]


# ------------------------------------------------------------------------------------------- losses


def test_loss_reduction_without_a_process_group_is_the_local_value():
    assert not dist.is_initialized()
    assert global_avg_and_max(torch.tensor(2.5)) == (2.5, 2.5)


@pytest.fixture
def gloo_world_of_one():
    assert not dist.is_initialized()
    with single_rank_process_group():
        yield init_device_mesh("cpu", (1,))


def test_loss_reduction_in_a_group_of_one_and_of_a_dtensor(gloo_world_of_one):
    assert global_avg_and_max(torch.tensor(1.25, dtype=torch.bfloat16)) == (1.25, 1.25)
    loss = distribute_tensor(torch.tensor(3.0), gloo_world_of_one, [Replicate()])
    assert global_avg_and_max(loss) == (3.0, 3.0)


def _two_rank_loss_reduction(rank: int, store_path: str) -> None:
    from titan_simple.parallel.torch_private import use_one_gloo_worker_thread

    use_one_gloo_worker_thread()  # as the trainer does
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        assert global_avg_and_max(torch.tensor(1.0 + 2.0 * rank)) == (2.0, 3.0)  # losses 1 and 3
        mesh = init_device_mesh("cpu", (2,))
        sharded = distribute_tensor(torch.tensor([4.0, 8.0]), mesh, [Shard(0)]).sum()  # a DTensor loss
        assert global_avg_and_max(sharded) == (12.0, 12.0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_loss_reduction_over_two_ranks(tmp_path):
    torch.multiprocessing.start_processes(
        _two_rank_loss_reduction, args=(str(tmp_path / "store"),), nprocs=2, start_method="fork"
    )


# ------------------------------------------------------------------------------------------- logger


def three_steps() -> dict[int, dict[str, float]]:
    return {
        step: {
            AVG_LOSS: 10.0 / step,
            MAX_LOSS: 11.0 / step,
            GRAD_NORM: 1.5 * step,
            LR: 1e-4 * step,
            TOKENS_PER_SECOND: 12345.0 + step,
            TFLOPS: 1.25,
            MFU: 40.0 + step,
            PEAK_RSS_GIB: 1.5,
            END_TO_END_SECONDS: 0.25,
            DATA_LOADING_SECONDS: 0.01,
            DATA_LOADING_PERCENT: 4.0,
        }
        for step in (1, 10, 20)
    }


def test_logger_writes_jsonl_tensorboard_and_a_console_line(tmp_path, caplog):
    logged = three_steps()
    with caplog.at_level(logging.INFO, logger="titan_simple"):
        with MetricsLogger(str(tmp_path), rank=0, enable_tensorboard=True, run_name="run") as metrics_logger:
            for step, values in logged.items():
                metrics_logger.log(step, values, total_steps=100, eta_seconds=83.4)

    expected = [{"step": step, **values} for step, values in logged.items()]
    assert read_metrics(tmp_path) == expected

    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(logged[1])
    for tag in logged[1]:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 10, 20]
        assert [s.value for s in scalars] == pytest.approx([logged[s][tag] for s in (1, 10, 20)], rel=1e-6)

    console = [r.getMessage() for r in caplog.records if r.name == "titan_simple.trainer.metrics"]
    assert console[1] == (
        "step  10/100 | loss 1.0000 | grad_norm 15 | lr 1.00e-03 | tps 12,355 | tflops 1.25 | mfu 50.0% | "
        "rss 1.50GiB | data 4.0% | eta 0:01:23"
    )


def test_console_line_shows_only_what_is_present(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="titan_simple"):
        with MetricsLogger(str(tmp_path), rank=0, enable_tensorboard=False) as metrics_logger:
            cuda_memory = {CUDA_MAX_RESERVED_GIB: 3.0, CUDA_MAX_RESERVED_PERCENT: 12.5}
            metrics_logger.log(7, {AVG_LOSS: 2.0, **cuda_memory})
    assert caplog.records[-1].getMessage() == "step 7 | loss 2.0000 | mem 3.00GiB (12.5%)"
    assert not (tmp_path / "tb").exists()


def test_only_the_logging_rank_writes(tmp_path):
    dump = tmp_path / "dump"
    metrics_logger = MetricsLogger(str(dump), rank=1, log_rank=0, enable_tensorboard=True)
    metrics_logger.log(1, {AVG_LOSS: 1.0})
    metrics_logger.close()
    assert not dump.exists()

    metrics_logger = MetricsLogger(str(dump), rank=3, log_rank=3, enable_tensorboard=False)
    metrics_logger.log(1, {AVG_LOSS: 1.0})
    metrics_logger.close()
    assert Path(metrics_logger.jsonl_path).read_text() == '{"step": 1, "loss_metrics/global_avg_loss": 1.0}\n'
    with pytest.raises(RuntimeError, match="after close"):
        metrics_logger.log(2, {AVG_LOSS: 1.0})


def test_timestamped_tensorboard_folder_without_a_run_name(tmp_path):
    metrics_logger = MetricsLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_tb_folder="board")
    with metrics_logger:
        metrics_logger.log(1, {LR: 1e-3})
    (run_folder,) = (tmp_path / "board").iterdir()
    assert metrics_logger.tb_folder == str(run_folder)
    assert run_folder.name[:8].isdigit() and any(run_folder.iterdir())


def test_a_float8_runs_step_line_says_which_peak_its_mfu_is_against():
    from titan_simple.trainer.metrics import _format_console_line

    metrics = {AVG_LOSS: 5.0, MFU: 52.5}
    assert "mfu 52.5% (float8 run, of the bf16 peak)" in _format_console_line(
        3, metrics, 10, None, mfu_note=" (float8 run, of the bf16 peak)")
    assert _format_console_line(3, metrics, 10, None).endswith("mfu 52.5%")


def test_nothing_is_written_before_the_first_log(tmp_path):
    """A run that fails before its first logged step leaves no metrics.jsonl and no TensorBoard folder; the first
    log opens both, in a dump folder that did not exist yet."""
    dump = tmp_path / "dump"
    unused = MetricsLogger(str(dump), rank=0, enable_tensorboard=True, run_name="run")
    unused.close(failed=True)
    assert not dump.exists()
    with pytest.raises(RuntimeError, match="after close"):
        unused.log(1, {AVG_LOSS: 1.0})
    assert not dump.exists()

    with MetricsLogger(str(dump), rank=0, enable_tensorboard=True, run_name="run") as metrics_logger:
        assert not dump.exists()
        metrics_logger.log(3, {AVG_LOSS: 2.5})
    assert read_metrics(dump) == [{"step": 3, AVG_LOSS: 2.5}]
    events = EventAccumulator(str(dump / "tb" / "run"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars(AVG_LOSS)] == [(3, 2.5)]


def test_a_missing_tensorboard_is_one_line(monkeypatch):
    from titan_simple.config import load_job_config
    from titan_simple.errors import ConfigError

    real = metrics_module.importlib.util.find_spec
    monkeypatch.setattr(metrics_module.importlib.util, "find_spec",
                        lambda name, *args: None if name == "tensorboard" else real(name, *args))
    config = load_job_config(["--config", "llama3_debug.toml"])
    with pytest.raises(ConfigError, match=r"needs the tensorboard package; pip install tensorboard, or pass "
                                          r"--metrics.enable_tensorboard=false\.$"):
        metrics_module.check_metrics_packages(config)
    config.metrics.enable_tensorboard = False
    metrics_module.check_metrics_packages(config)
