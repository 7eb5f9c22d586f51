"""Config loading: TOML + CLI precedence, typed errors, shipped configs, help text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.harness import DEBUG, REPO, TRAIN_PY, run_python, train_py
from titan_simple.config import help_text, load_job_config
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import LLAMA3_FLAVORS
from titan_simple.parallel.dims import ParallelDims


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    config = load_job_config(["--config", path, "--training.steps", "9", "--optimizer.lr=2e-3"])
    assert config.training.steps == 9  # CLI beats TOML
    assert config.training.seq_len == 64  # TOML beats default
    assert config.optimizer.lr == 2e-3
    assert config.training.local_batch_size == 8  # default
    assert config.sources["training.steps"] == "command line"
    assert config.sources["training.seq_len"] == path


def test_cli_value_kinds():
    config = load_job_config([
        "--compile.enable", "--training.dataset_path", "none", "--lr_scheduler.decay_ratio", "0.5",
        "--training.deterministic=false", "--optimizer.lr", "1",
    ])
    assert config.compile.enable is True
    assert config.training.dataset_path is None
    assert config.lr_scheduler.decay_ratio == 0.5
    assert config.training.deterministic is False
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


def test_bare_config_name_resolves_in_configs_folder():
    config = load_job_config(["--config", "llama3_8b.toml"])
    assert config.model.flavor == "8B"
    assert config.config_file == str(REPO / "configs" / "llama3_8b.toml")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stepz", "3"], "unknown key 'stepz' in [training]. Did you mean 'steps'?"),
        (["--traning.steps", "3"], "unknown section [traning]. Did you mean 'training'?"),
        (["--training.steps", "abc"], "[training] steps = 'abc' has the wrong type; expected int."),
        (["--training.steps", "-3"], "[training] steps = -3 is impossible; expected a positive number"),
        (["--training.seq_len", "1.5"], "[training] seq_len = 1.5 has the wrong type; expected int."),
        (["--compile.backend", "tvm"], "[compile] backend = 'tvm' is not allowed; choose one of inductor, aot_eager"),
        (["--config", "missing.toml"], "config file 'missing.toml' not found"),
        (["--training.steps"], "--training.steps needs a value (int)"),
        (["positional"], "unexpected argument 'positional'"),
        (["--parallelism.tensor_parallel_degree", "0"], "tensor_parallel_degree = 0 is impossible"),
        (["--activation_checkpoint.selective_ac_option", "sometimes"], "selective_ac_option = 'sometimes'"),
    ],
)
def test_bad_input_names_the_key(argv, message):
    with pytest.raises(ConfigError) as error:
        load_job_config(argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_toml_errors_name_the_file(tmp_path):
    path = write(tmp_path, "[training]\nsteps = \"ten\"\n")
    with pytest.raises(ConfigError, match=r"job.toml: \[training\] steps = 'ten' has the wrong type"):
        load_job_config(["--config", path])
    path = write(tmp_path, "[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_config(["--config", path])
    path = write(tmp_path, "steps = 1\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_job_config(["--config", path])


@pytest.mark.parametrize("name", ["llama3_debug.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"])
def test_shipped_configs_load(name):
    config = load_job_config(["--config", name])
    assert config.training.steps > 0


@pytest.mark.parametrize(
    "name, world_size, expected",
    [("llama3_8b.toml", 8, (1, 8, 1, 1)), ("llama3_70b.toml", 256, (1, 32, 8, 1)),
     ("llama3_405b.toml", 512, (1, 8, 8, 8))],
)
def test_shipped_layouts_fit_their_world_size(name, world_size, expected):
    """The cluster configs validate for their intended world size (degrees, head/vocab/seq_len divisibility,
    the pipeline split), all without building the model or a process group."""
    from titan_simple.core.plan import resolve_plan

    config = load_job_config(["--config", name])
    run = resolve_plan(config, world_size, "cuda")
    dims = run.dims
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == expected
    n_layers = LLAMA3_FLAVORS[config.model.flavor].n_layers
    if dims.pp > 1:
        layers = [i for stage in run.pipeline.stage_layers for i in stage]
        assert layers == list(range(n_layers))  # every layer once, in order
    assert run.precision.param_dtype == torch.bfloat16 and run.precision.autocast_dtype is None
    assert 4 <= len(run.describe()) <= 8


def test_degrees_that_do_not_multiply_to_world_size():
    with pytest.raises(ConfigError, match="= 6 but the world size is 4"):
        ParallelDims(dp_replicate=1, dp_shard=3, tp=2, pp=1, world_size=4)
    with pytest.raises(ConfigError, match="= 3 does not divide the world size 4"):
        ParallelDims(dp_replicate=3, dp_shard=-1, tp=1, pp=1, world_size=4)
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=1, pp=1, world_size=4)
    assert dims.dp_shard == 2 and dims.data_parallel_mode == "hybrid_shard"


def test_help_lists_every_key_with_default():
    text = help_text()
    for key in ("--training.local_batch_size", "--parallelism.data_parallel_shard_degree", "--metrics.log_freq",
                "--compile.enable", "--lr_scheduler.min_lr_factor"):
        assert key in text
    assert "default 8" in text
    # compile once: what makes ranks share graphs, not "rank 0 compiles" (several do under TP, CP or HSDP)
    once = text[text.index("--compile.compile_on_one_rank"):text.index("--compile.precompile_world_size")]
    assert "same process group in every other mesh dimension" in " ".join(once.split())


def _titan_run(*args: str) -> subprocess.CompletedProcess:
    return run_python("-m", "titan_simple.trainer.launch", "--nproc_per_node=2", TRAIN_PY, *DEBUG, *args,
                      timeout=300, expect=None)


def test_titan_run_reports_a_config_error_in_one_line_before_any_rank_starts():
    """torchrun reports its ranks' one line with its ChildFailedError traceback and exit status 1; titan-run checks
    the config for the job's world size first: one line, status 2, and no rank started (no torchrun banner)."""
    for args, line in ((("--training.stepz", "1"), "error: command line: unknown key 'stepz' in [training]. Did you "
                        "mean 'steps'?"),
                       (("--parallelism.tensor_parallel_degree", "3"), "error: [parallelism] data_parallel_replicate_"
                        "degree x context_parallel_degree x tensor_parallel_degree x pipeline_parallel_degree = 3 does "
                        "not divide the world size 2; launch a multiple of 3 processes or lower the degrees.")):
        done = _titan_run(*args)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [line], done.stderr[-2000:]


def test_titan_run_exits_with_a_ranks_own_error_status_without_a_traceback(tmp_path):
    """An error only the ranks find (a corrupt checkpoint): each prints its line, titan-run exits 2 quietly."""
    common = ("--model.n_layers", "1", "--checkpoint.enable", "--checkpoint.interval", "1", "--job.dump_folder",
              str(tmp_path), "--metrics.enable_tensorboard=false")
    train_py(*DEBUG, "--training.steps", "1", *common, timeout=300)
    for shard in (tmp_path / "checkpoint" / "step-1").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    done = _titan_run("--training.steps", "2", *common)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and errors and all("step-1 cannot be read" in e for e in errors), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr and "exitcode" not in done.stderr


def test_the_parts_of_torchrun_titan_run_uses_exist():
    """titan-run (trainer/launch.py) calls torchrun's module and filters its agent's line on a failed rank."""
    import inspect

    import torch.distributed.elastic.multiprocessing.api as agent
    import torch.distributed.run as torchrun

    from titan_simple.trainer import launch

    assert all(callable(getattr(torchrun, name, None)) for name in ("parse_args", "run", "parse_min_max_nnodes",
                                                                    "determine_local_world_size"))
    assert agent.__name__ == launch.AGENT_LOGGER and hasattr(agent, "SignalException")
    assert launch.FAILED_RANK_LINE.split("{")[0] in inspect.getsource(agent)


def test_train_py_reports_one_line_and_exit_code_2():
    result = train_py(*DEBUG, "--training.stepz", "1", timeout=60, expect=None, launch=True)  # the command's status
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: command line: unknown key 'stepz' in [training]. Did you mean 'steps'?"
    ]


@pytest.mark.parametrize(("flags", "native", "cpu_dtype"), [
    ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True, "bfloat16"),  # AVX512-BF16 (this project's EPYC)
    ("fpu sse2 avx2 amx_tile amx_bf16", True, "bfloat16"),                # AMX
    ("fpu sse2 avx2 avx512f avx512bw", False, "float32"),                 # bf16 only emulated: slower than fp32
])
def test_auto_precision_is_bf16_on_gpus_and_on_cpus_with_native_bf16(tmp_path, monkeypatch, flags, native, cpu_dtype):
    import torch

    from titan_simple.core import plan
    from titan_simple.parallel.dims import ParallelDims

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert plan.cpu_has_native_bf16(str(cpuinfo)) is native
    assert plan.cpu_has_native_bf16(str(tmp_path / "missing")) is False  # no /proc: fp32, safe
    monkeypatch.setattr(plan, "cpu_has_native_bf16", lambda: native)
    config = load_job_config([])
    assert config.training.mixed_precision_param == "auto"
    dp2, single = ParallelDims(1, 2, 1, 1, 2), ParallelDims(1, 1, 1, 1, 1)
    cpu = plan.choose_precision(config, dp2, "cpu")
    assert cpu.param_dtype == getattr(torch, cpu_dtype)
    assert cpu.autocast_dtype is None  # data parallel casts the weights
    assert plan.choose_precision(config, dp2, "cuda").param_dtype == torch.bfloat16  # GPUs: always bf16
    # Without data parallel nothing casts the weights: a bf16 forward runs under autocast.
    assert plan.choose_precision(config, single, "cuda").autocast_dtype == torch.bfloat16
    assert plan.choose_precision(config, single, "cpu").autocast_dtype == (torch.bfloat16 if native else None)
    pinned = load_job_config(["--training.mixed_precision_param", "float32"])
    assert plan.choose_precision(pinned, dp2, "cpu").param_dtype == torch.float32
