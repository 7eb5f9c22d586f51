"""The run plan (``core/plan.py``): every derived decision in one place, used by everything that builds a step.

The structural tests read the source: each decision has exactly one function, only the resolver calls it, and
no module reads a decision's config key to decide again. The package layers point one way and no module
imports itself back through another.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest
import torch

from tests.harness import REPO, run_python
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError

PLAN_FILE = REPO / "titan_simple" / "core" / "plan.py"
# Every derived decision's function (in core/plan.py, the model's in models/from_config.py); resolve_plan is the
# only caller outside tests.
DECISIONS = (
    "model_args_for", "plan_pipeline", "accumulation_steps", "choose_fsdp_gather", "choose_precision",
    "cpu_has_native_bf16", "choose_compile_mode", "uses_loss_parallel", "choose_reshard_after_forward",
    "plan_validation", "choose_loss_chunks", "choose_async_tensor_parallel", "plan_attention", "plan_optimizer",
    "plan_stages",
)
# Outside the resolver, only generation resolves one decision: the model of the config, built on one process
# without a layout (a Hugging Face folder's or the flavor's; titan_simple/generate.py). The stage table (which the
# resolver makes with plan_stages) gives each stage its accumulation by the same rule.
ALSO_CALLED_BY = {"model_args_for": {"titan_simple/generate.py"}, "accumulation_steps": {"titan_simple/core/stages.py"}}
# Config keys that feed a decision: read only by the config package and the plan.
DECISION_KEYS = {
    "parallelism": {"fsdp_gather", "fsdp_reshard_after_forward", "fsdp_implementation", "disable_loss_parallel",
                    "pipeline_parallel_schedule", "enable_async_tensor_parallel"},
    "training": {"mixed_precision_param", "mixed_precision_reduce", "global_batch_size", "shuffle"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "bucketing", "reorder", "backend", "manual_bucketed_modules"},
    "model": {"attention", "attention_mask"},
}
# Lower layers first; a module may import only from its own package or a lower layer.
# The core (plan, build, step) sits on the parallelisms and the compiler; the trainer and the dry run are siblings
# above it that import only the core and below.
LAYERS = {"errors": 0, "config": 1, "models": 2, "data": 3, "parallel": 3, "compile": 4, "core": 5, "trainer": 6,
          "dry_run": 6, "generate": 7}


def _sources() -> dict[Path, ast.Module]:
    files = [*(REPO / "titan_simple").rglob("*.py"), *(REPO / "scripts").rglob("*.py"), REPO / "train.py"]
    return {f: ast.parse(f.read_text()) for f in files}


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def test_each_decision_has_one_function_and_only_the_resolver_calls_it():
    definitions = collections.Counter()
    callers: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in DECISIONS:
                definitions[node.name] += 1
            if isinstance(node, ast.Call) and _called_name(node) in DECISIONS:
                callers[_called_name(node)].add(str(path.relative_to(REPO)))
    assert definitions == collections.Counter({name: 1 for name in DECISIONS})
    plan_file = str(PLAN_FILE.relative_to(REPO))
    assert {name: callers[name] for name in DECISIONS} == {
        name: {plan_file, *ALSO_CALLED_BY.get(name, ())} for name in DECISIONS}


def test_no_module_reads_a_decision_key_but_the_config_and_the_plan():
    readers = []
    for path, tree in _sources().items():
        if path.parent.name == "config" or path == PLAN_FILE:
            continue
        for node in ast.walk(tree):
            # <anything>.<section>.<key>, e.g. config.parallelism.fsdp_gather
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.attr in DECISION_KEYS.get(node.value.attr, ()) and _is_config_section(node.value)):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.value.attr}.{node.attr}")
    assert readers == []


def _is_config_section(node: ast.Attribute) -> bool:
    """``config.<section>`` or ``<x>.config.<section>``: a JobConfig's section, not a plan's field."""
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return name == "config"


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _titan_imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in (REPO / "titan_simple").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module:  # from package import module
                names += [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
            edges[module] |= {n for n in names if n.startswith("titan_simple.")}
    return edges


def test_packages_import_only_lower_layers():
    def package(module: str) -> str:
        return module.split(".")[1]

    upward = sorted(f"{a} -> {b}" for a, targets in _titan_imports().items() for b in targets
                    if package(a) != package(b) and LAYERS[package(b)] >= LAYERS[package(a)])
    assert upward == []


def test_every_module_imports():
    """Every module of the package imports (a lazily imported one too: the layout search's broke unseen once)."""
    import importlib
    import pkgutil

    import titan_simple

    failed = {}
    for module in pkgutil.walk_packages(titan_simple.__path__, "titan_simple."):
        try:
            importlib.import_module(module.name)
        except Exception as error:  # noqa: BLE001 -- every failure is reported
            failed[module.name] = f"{type(error).__name__}: {error}"
    assert failed == {}


def test_no_import_cycle():
    edges = _titan_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_package_modules_stay_under_500_lines():
    # config/schema.py is declarations only, each field documented where declared (the --help manual)
    long = {str(p.relative_to(REPO)): n for p in (REPO / "titan_simple").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500 and p != REPO / "titan_simple" / "config" / "schema.py"}
    assert long == {}


# The assembly (plan -> mesh -> parts -> optimizer -> step) is written once, in core/assemble.py; everything
# that builds a run (the trainer, the dry run, the search workers, the parity tests, the scripts) calls build_run.
ASSEMBLY_STEPS = ("build_model_parts", "build_train_step", "optimizer_from_config")
ASSEMBLY_FILE = REPO / "titan_simple" / "core" / "assemble.py"
# Feature modules the step must not import: a feature reaches the step as a StepFeature the assembly installs.
FEATURE_MODULES = ("titan_simple.trainer.fault_tolerance", "titan_simple.parallel.float8_gather",
                   "titan_simple.models.float8")


def test_the_assembly_is_written_once_and_everything_calls_it():
    sources = _sources()
    sources.update({path: ast.parse(path.read_text()) for path in (REPO / "tests").glob("*.py")})
    callers = collections.defaultdict(set)
    for path, tree in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node) in (*ASSEMBLY_STEPS, "build_run"):
                callers[_called_name(node)].add(str(path.relative_to(REPO)))
    assert {name: callers[name] for name in ASSEMBLY_STEPS} == {
        name: {str(ASSEMBLY_FILE.relative_to(REPO))} for name in ASSEMBLY_STEPS}
    assert {"titan_simple/trainer/trainer.py", "titan_simple/dry_run/rank_step.py",
            "titan_simple/dry_run/cpu_measurement.py", "tests/parity.py", "scripts/gpu_check.py",
            "scripts/benchmarks/measure_memory.py"} <= callers["build_run"]


def test_no_function_over_60_lines():
    long = sorted(f"{path.relative_to(REPO)}:{node.name} {node.end_lineno - node.lineno + 1}"
                  for path in (REPO / "titan_simple").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.end_lineno - node.lineno + 1 > 60)
    assert long == []


def test_scripts_import_the_installed_package_without_editing_sys_path():
    edits = sorted(str(path.relative_to(REPO)) for path in (REPO / "scripts").rglob("*.py")
                   if "sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text())
    assert edits == []


def test_the_step_imports_no_feature_module():
    step = REPO / "titan_simple" / "core" / "step.py"
    imported = {node.module for node in ast.walk(ast.parse(step.read_text())) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint(FEATURE_MODULES)


def test_the_loop_names_no_feature_and_only_the_feature_assembly_imports_fault_tolerance():
    """Fault tolerance reaches the loop as a LoopFeature (trainer/loop_feature.py) that trainer/features.py
    assembles: trainer.py has no replica branch and imports no feature module, and no other package module imports
    fault tolerance."""
    trainer = REPO / "titan_simple" / "trainer" / "trainer.py"
    source = trainer.read_text()
    assert "replicas" not in source and "fault_tolerance" not in source
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint(FEATURE_MODULES) and "titan_simple.trainer.features" in imported
    package = REPO / "titan_simple"
    importers = {str(path.relative_to(REPO)) for path, tree in _sources().items() if path.is_relative_to(package)
                 for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module == "titan_simple.trainer.fault_tolerance"}
    assert importers == {"titan_simple/trainer/features.py"}


# ---------------------------------------------------------------------------------------------- behaviour


def _config(*overrides: str):
    return load_job_config(["--config", "llama3_debug.toml", "--training.seq_len=64", "--training.local_batch_size=2",
                            *overrides])


def test_plan_of_the_default_job_says_what_runs_and_why():
    run = resolve_plan(_config("--training.mixed_precision_param=float32"), 2, "cpu")
    lines = run.describe()
    assert len(lines) <= 8
    assert lines[0].startswith("plan: llama3 debugmodel (6 layers") and "dp_shard2" in lines[0]
    text = "\n".join(lines)
    assert "SimpleFSDP fully_shard, reshard after forward (default: no pipeline)" in text
    assert "gather per_microbatch (auto: no pipeline)" in text
    assert "float32 compute, float32 reduce, no autocast" in text
    assert "4 x 64 = 256 tokens per step | local 2 x 1 accumulation" in text
    assert (run.accumulation_steps, run.data.global_rows, run.data.shuffle_seed) == (1, 4, 0)
    assert run.compile.mode == "off" and not run.loss.parallel and not run.loss.compiled_with_model


@pytest.mark.parametrize(("world", "overrides", "expected"), [
    (2, ("--compile.enable",), ("whole_with_loss", False, True, "per_microbatch")),
    (4, ("--compile.enable", "--parallelism.tensor_parallel_degree=2"), ("whole", True, True, "per_microbatch")),
    (4, ("--compile.enable", "--parallelism.pipeline_parallel_degree=2"), ("whole", False, False, "once_per_step")),
    (4, ("--compile.enable", "--parallelism.pipeline_parallel_degree=2", "--parallelism.tensor_parallel_degree=2",
         "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--training.local_batch_size=4"),
     ("whole", True, False, "per_microbatch")),
    (2, ("--compile.enable", "--parallelism.fsdp_implementation=fsdp2"), ("per_block", False, True, "per_microbatch")),
])
def test_plan_decides_compile_loss_and_gather_modes_together(world, overrides, expected):
    """(compile mode, loss parallel, reshard after forward, gather mode) of typical layouts."""
    run = resolve_plan(_config(*overrides), world, "cpu")
    assert (run.compile.mode, run.loss.parallel, run.parallel.reshard_after_forward, run.fsdp_gather) == expected
    assert run.loss.compiled_with_model == (expected[0] == "whole_with_loss")
    assert run.without_compile().compile.mode == "off" and run.without_compile().loss == run.loss


REGIONAL = ("--compile.enable", "--compile.regional")


@pytest.mark.parametrize(("world", "overrides", "handoff"), [
    (2, REGIONAL, True),  # fully_shard
    (2, (*REGIONAL, "--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2"),
     True),
    (4, (*REGIONAL, "--parallelism.tensor_parallel_degree=2"), True),  # dp2 x tp2
    (2, (*REGIONAL, "--parallelism.tensor_parallel_degree=2"), False),  # no data parallel: nothing to gather
    (4, (*REGIONAL, "--parallelism.pipeline_parallel_degree=2", "--parallelism.fsdp_gather=per_microbatch"), False),
    (2, (*REGIONAL, "--parallelism.fsdp_gather=once_per_step"), False),  # every weight held for the step already
    (2, (*REGIONAL, "--compile.reorder=false"), False),  # it would hold weights and hide nothing
    (2, ("--compile.enable",), False),  # whole-model compile
])
def test_regional_hand_off_where_it_can_hide_something(world, overrides, handoff):
    """Regional compilation's hand-off (compile/regions.py): each region gathers the next one's first weights,
    only where SimpleFSDP gathers them per microbatch, reordered, in one pipeline stage."""
    assert resolve_plan(_config(*overrides), world, "cpu").compile.region_handoff is handoff


@pytest.mark.parametrize(("world", "overrides", "message"), [
    (3, ("--parallelism.tensor_parallel_degree=2",), "does not divide the world size 3"),
    (2, ("--training.global_batch_size=6",), "global_batch_size = 6 is not a multiple"),
    (2, ("--parallelism.tensor_parallel_degree=2", "--validation.enable", "--validation.seq_len=63"),
     r"\[validation\] seq_len = 63 is not a multiple"),
    (4, ("--parallelism.pipeline_parallel_degree=2", "--validation.enable", "--validation.local_batch_size=1"),
     r"\[validation\] local_batch_size = 1 must be a multiple"),
    (2, ("--parallelism.fsdp_gather=once_per_step", "--parallelism.fsdp_implementation=fsdp2"), "needs SimpleFSDP"),
    (2, ("--model.flavor=7B",), "flavor '7B' is unknown"),
])
def test_resolving_raises_every_check_that_needs_no_communication(world, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_plan(_config(*overrides), world, "cpu")


def test_steps_built_by_the_parity_helper_and_the_dry_run_use_the_trainers_autocast_and_loss(monkeypatch):
    """A bf16 layout without data parallel: nothing casts the weights, so the trainer's step runs under autocast.
    The parity helper and the dry run build their step from the same plan, so they get it too (and the
    trainer's loss): the model's matmuls compute in bf16 although the weights are fp32."""
    from tests.parity import build_layout
    from titan_simple.dry_run import rank_step

    config = _config("--training.mixed_precision_param=bfloat16", "--model.flavor=debugmodel")
    layout = build_layout(config)
    assert layout.plan.precision.autocast_dtype == torch.bfloat16
    context = layout.step.autocast()
    assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
    dtypes = []
    layer = layout.parts.model.layers["0"].attention.wq
    handle = layer.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    inputs = torch.randint(0, 2000, (2, 64))
    result = layout.step([(inputs, inputs)])
    handle.remove()
    assert dtypes == [torch.bfloat16] and layer.weight.dtype == torch.float32
    assert torch.isfinite(result.loss_sum)

    built = []
    real = rank_step.build_run
    monkeypatch.setattr(rank_step, "build_run", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    rank_step.trace_rank(resolve_plan(config, 1, "cpu"), None)
    (step,) = [run.step for run in built]
    assert step.plan.precision.autocast_dtype == torch.bfloat16
    traced_context = step.autocast()
    assert isinstance(traced_context, torch.autocast) and traced_context.fast_dtype == torch.bfloat16
    logits, labels = torch.randn(1, 4, 8), torch.randint(0, 8, (1, 4))
    assert torch.equal(step.loss(logits, labels, 0.5), layout.plan.loss.scaled(logits, labels, 0.5))


LIGHT_SCRIPT_IMPORTS = """
import sys
import titan_simple.trainer.fault_tolerance, titan_simple.trainer.run_status  # scripts/run_status.py, the launcher
heavy = ("titan_simple.core.step", "titan_simple.core.build", "titan_simple.parallel.parallelize",
         "torch.distributed.pipelining", "torch._dynamo", "torch._inductor.compile_fx")
print("HEAVY", [m for m in heavy if m in sys.modules])
"""


def test_the_status_and_launcher_scripts_import_no_model_or_compiler():
    """scripts/run_status.py and scripts/fault_tolerance.py answer in a couple of seconds: the fault-tolerance and
    run-status modules they import reach neither the model, the parallelisms nor the compiler (a StepFeature
    import from core/step.py once cost every call of run_status.py ~2 s)."""
    done = run_python("-c", LIGHT_SCRIPT_IMPORTS, timeout=120, expect=None)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr[-2000:]
