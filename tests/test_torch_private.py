"""The private torch APIs we use still exist, and no module but the guarded ones imports one: the parallelisms'
(``titan_simple/parallel/torch_private.py``), the compiler's (``titan_simple/compile/inductor_private.py``), the dry
run's (``titan_simple/dry_run/torch_private.py``) and the trainer's (``titan_simple/trainer/torch_private.py``).

A torch upgrade that renames or removes one should fail here, with the API's name and what it is for. Without
this test it would fail in the middle of a compiled or multi-process run. If it fails, fix the module that
names the API (the only one that uses it) rather than skipping the test.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import types
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import single_rank_process_group
from tests.harness import REPO, run_python

PRIVATE_MODULES = ("titan_simple.parallel.torch_private", "titan_simple.compile.inductor_private",
                   "titan_simple.dry_run.torch_private", "titan_simple.trainer.torch_private")
# Each guarded module and the private torch modules it imports (checked with torch 2.13): a new private import is
# added here, with its entries in the module's PRIVATE_APIS, or the test below fails.
PRIVATE_IMPORTS = {
    "titan_simple/parallel/torch_private.py": {
        "torch._functorch.config", "torch.distributed._functional_collectives", "torch.distributed._symmetric_memory",
        "torch.distributed.tensor._utils", "torch.utils._python_dispatch",
        "torch.testing._internal.distributed.fake_pg"},
    "titan_simple/compile/inductor_private.py": {
        "torch._dynamo.config", "torch._dynamo.utils", "torch._functorch._aot_autograd", "torch._functorch.config",
        "torch._functorch.partitioners", "torch._inductor", "torch._inductor.compile_fx", "torch._inductor.config",
        "torch._inductor.config_comms", "torch._inductor.fx_passes", "torch._inductor.runtime", "torch._ops",
        "torch._prims.rng_prims", "torch.utils._pytree", "torch.utils._runtime_estimation"},
    "titan_simple/dry_run/torch_private.py": {
        "torch._subclasses", "torch.distributed.tensor._sharding_prop", "torch.utils._pytree"},
    "titan_simple/trainer/torch_private.py": {"torch.cuda.memory._record_memory_history",
                                              "torch.cuda.memory._dump_snapshot"},
}


def _import(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except (ImportError, AttributeError) as e:  # a module-level import or re-export of a private name failed
        pytest.fail(f"torch {torch.__version__}: {name} does not import: {e}")


def _parallel_private() -> types.ModuleType:
    return _import(PRIVATE_MODULES[0])


def _compile_private() -> types.ModuleType:
    return _import(PRIVATE_MODULES[1])


def _all_private_apis() -> list[tuple[object, str, str]]:
    return [entry for name in PRIVATE_MODULES for entry in _import(name).PRIVATE_APIS]


def _name(owner: object) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return repr(owner)


def test_every_private_api_exists():
    missing = [
        f"{_name(owner)}.{attr} (needed by {why})"
        for owner, attr, why in _all_private_apis()
        if not hasattr(owner, attr)
    ]
    for module, attr, why in _parallel_private().LAZY_PRIVATE_APIS:
        if not hasattr(importlib.import_module(module), attr):
            missing.append(f"{module}.{attr} (needed by {why})")
    assert not missing, f"torch {torch.__version__} lacks private APIs titan_simple uses:\n  " + "\n  ".join(missing)


def _is_private(dotted: str) -> bool:
    """A name inside torch with an underscored part (``torch.ops.<namespace>`` is the op registry: not a module)."""
    parts = dotted.split(".")
    return (parts[0] == "torch" and parts[1:2] != ["ops"]
            and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]))


def _private_torch_names(path: Path, references: bool) -> set[str]:
    """The private torch modules (and names) ``path`` imports; with ``references``, also the private
    ``torch.<...>._x`` names its code reaches."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _is_private(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            found |= {node.module} if _is_private(node.module) else {
                f"{node.module}.{a.name}" for a in node.names if _is_private(f"{node.module}.{a.name}")}
        elif references and isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch" and _is_private(".".join(["torch", *chain[::-1]])):
                found.add(".".join(["torch", *chain[::-1]]))
    return found


def test_private_torch_apis_are_imported_by_the_guarded_modules_only():
    """No module but a guarded one imports a private torch module or reaches a ``torch._x`` name, and each guarded
    module imports exactly the private modules listed above (its lazy imports included)."""
    sources = sorted((REPO / "titan_simple").rglob("*.py"))
    outside = {str(p.relative_to(REPO)): names for p in sources if str(p.relative_to(REPO)) not in PRIVATE_IMPORTS
               and (names := _private_torch_names(p, references=True))}
    assert outside == {}, "import these through the package layer's guarded module (a torch_private.py)"
    assert {path: _private_torch_names(REPO / path, references=False) for path in PRIVATE_IMPORTS} == PRIVATE_IMPORTS


def test_the_list_covers_the_new_entries():
    """The mesh, placement and functorch APIs of dims.py / simple_fsdp.py / pipeline.py are in the list too,
    not only the Inductor ones."""
    from torch.distributed.device_mesh import DeviceMesh

    private, compiler = _parallel_private(), _compile_private()
    listed = {(owner, attr) for owner, attr, _ in _all_private_apis()}
    for owner, attr in ((DeviceMesh, "_flatten"), (DeviceMesh, "_get_root_mesh"),
                        (private.functorch_config, "donated_buffer"), (private.placement_types, "_StridedShard"),
                        (compiler.inductor_config, "post_grad_custom_post_pass"),
                        (compiler.functorch_config, "force_non_lazy_backward_lowering")):
        assert (owner, attr) in listed, f"{_name(owner)}.{attr} is used but not in PRIVATE_APIS"


def test_inductor_config_keys_and_signatures():
    """The keyword arguments compile.py passes, and the config it relies on staying at its default."""
    private = _compile_private()
    dist_opts = private.inductor_config.aten_distributed_optimizations
    for name in ("enable_overlap_scheduling", "collective_bucketing", "custom_runtime_estimation"):
        assert hasattr(dist_opts, name), f"torch._inductor.config.aten_distributed_optimizations lost {name!r}"
    params = inspect.signature(private.schedule_overlap_bucketing).parameters
    for name in ("collective_bucketing", "custom_runtime_estimation", "compute_estimator", "insert_overlap_deps",
                 "pre_bucketing_fsdp_collectives", "bucket_only_internode_comms"):
        assert name in params, f"schedule_overlap_bucketing lost its {name!r} argument"
    params = inspect.signature(private.manual_overlap_bucketing).parameters
    missing = {"gm", "module_bucket_plans", "insert_overlap_deps"} - set(params)
    assert not missing, f"manual_overlap_bucketing lost its {sorted(missing)} argument(s)"
    params = inspect.signature(private.ManualOverlapScheduler).parameters
    assert "insert_overlap_deps" in params, "ManualOverlapScheduler lost its 'insert_overlap_deps' argument"


def test_the_wrappers_work():
    """The wrappers call the private APIs with arguments those still accept."""
    private, compiler = _parallel_private(), _compile_private()
    assert compiler.op_schema(torch.ops.aten.mm.default).name == "aten::mm"
    with private.no_donated_buffers():
        assert torch._functorch.config.donated_buffer is False
    assert isinstance(private.StridedShard(0, split_factor=2), torch.distributed.tensor.Placement)
    # The DeviceMesh methods need a process group to run; check they still take the arguments we pass.
    inspect.signature(private.DeviceMesh._flatten).bind(None, "dp")
    inspect.signature(private.DeviceMesh._get_root_mesh).bind(None)


REPRO_RNG = REPO / "tests" / "repro_rng_state_after_device_mesh.py"


def _repro(*args: str) -> subprocess.CompletedProcess:
    return run_python(REPRO_RNG, *args, env=os.environ, timeout=600, expect=None)


def test_compiled_recompute_of_attention_over_dtensor_parameters_matches_eager():
    """``prepare_compile``'s fix of ``functionalize_rng_ops``: full recompute of SDPA over SimpleFSDP weights
    compiles and gives eager's loss and gradients exactly."""
    done = _repro()
    assert done.returncode == 0, done.stdout + done.stderr
    eager = re.search(r"eager loss ([\d.]+)", done.stdout).group(1)
    assert f"compiled: loss {eager}, largest gradient difference from eager 0.00e+00" in done.stdout, done.stdout


def test_torch_still_needs_the_rng_state_fix():
    """Without the fix torch 2.13 fails the same step. When this test fails, torch has fixed the bug
    (docs/research/upstream_rng_state_after_opaque.md): drop the wrapper in ``compile/inductor_private.py``."""
    done = _repro("--without-fix")
    assert done.returncode == 1 and "DeviceMesh" in done.stdout, done.stdout + done.stderr


def test_the_rank_local_scheduler_overrides_a_method_torch_calls():
    """schedule_overlap_rank_local swaps in a scheduler whose cross-rank alignment is a no-op: the base class
    must still have that method, run() must still call it, and schedule_overlap_bucketing must still build the
    scheduler by the module-level name we swap."""
    private = _compile_private()
    base = private.overlap_scheduling.OverlapScheduler
    name = "_align_compute_nodes_runtime_estimations_across_all_distributed_ranks"
    assert name in inspect.getsource(base.run), f"OverlapScheduler.run no longer calls {name}"
    assert "OverlapScheduler(" in inspect.getsource(private.schedule_overlap_bucketing)
    assert private._RankLocalOverlapScheduler.__mro__[1] is base
    with pytest.raises(ValueError, match="compute_estimator='analytical'"):
        private.schedule_overlap_rank_local(None, custom_runtime_estimation=None, compute_estimator="analytical")


def test_rank_local_options_are_inductor_settings_and_nothing_syncs_by_default():
    private = _compile_private()
    current = private.inductor_config.get_config_copy()
    options = private.rank_local_compile_options()
    assert len(options) == 4  # torch 2.13 has all four; one missing in a newer torch is left out silently
    for key, value in options.items():
        assert key in current and value is False, key
    assert private.cross_rank_compile_settings() == []


def test_cross_rank_compile_settings_stop_a_compiled_pipeline_run():
    from titan_simple.config import load_job_config
    from titan_simple.core.plan import resolve_plan
    from titan_simple.errors import ConfigError

    private = _compile_private()
    config = load_job_config(["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=2",
                              "--compile.enable"])
    with private.dynamo_config.patch(enable_compiler_collectives=True):
        with pytest.raises(ConfigError, match="TORCH_COMPILER_COLLECTIVES=1 .* deadlocks pipeline stages"):
            resolve_plan(config, 2, "cpu")
        resolve_plan(load_job_config(["--compile.enable"]), 2, "cpu")  # without pipeline parallel it is fine
    assert private.dynamo_config.enable_compiler_collectives is False


def test_analytical_estimates_need_no_other_rank():
    """The GPU runtime model prices a collective by Inductor's NCCL formula (no NCCL call) and a matmul by the
    roofline, from the node alone."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from tests.distributed_utils import single_rank_process_group
    from titan_simple.compile.cpu_cost_model import cpu_roofline

    private = _compile_private()
    with single_rank_process_group():
        group = dist.group.WORLD.group_name

        def f(x, w):
            gathered = torch.ops._c10d_functional.all_gather_into_tensor.default(w, 1, group)
            return x @ torch.ops._c10d_functional.wait_tensor.default(gathered)

        graph = make_fx(f)(torch.randn(64, 32), torch.randn(32, 16)).graph
        nodes = {n.target: n for n in graph.nodes if n.op == "call_function"}
        with cpu_roofline(None):
            gather = private.analytical_runtime_ms(nodes[torch.ops._c10d_functional.all_gather_into_tensor.default])
            matmul = private.analytical_runtime_ms(nodes[torch.ops.aten.mm.default])
            wait = private.analytical_runtime_ms(nodes[torch.ops._c10d_functional.wait_tensor.default])
        assert gather == 0  # a group of one rank moves nothing
        assert matmul > 0 and wait >= 0


def test_process_group_timeouts_can_be_read_and_changed():
    import torch.distributed as dist

    from tests.distributed_utils import single_rank_process_group

    private = _parallel_private()
    with single_rank_process_group():
        private.set_process_group_timeout(None, 42)
        assert private.process_group_timeout_seconds() == 42.0
        group = dist.new_group([0])
        private.set_process_group_timeout(group, 7.5)
        assert private.process_group_timeout_seconds(group) == 7.5


def test_gloo_groups_get_one_worker_thread(monkeypatch):
    """use_one_gloo_worker_thread reaches the default group and new groups; torch's own default is 2 threads, so
    this fails if torch stops building gloo backends through the names it swaps. The backends stay torch's
    class for torch's own isinstance checks: the timeout still reaches them (a subclass left in place did not)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tests.distributed_utils import gloo_worker_threads
    from titan_simple.parallel.torch_private import (
        process_group_timeout_seconds,
        set_process_group_timeout,
        use_one_gloo_worker_thread,
    )

    # torch's own function (an earlier test in this process may have wrapped it already); restored after the test
    helper = c10d._new_process_group_helper
    monkeypatch.setattr(c10d, "_new_process_group_helper", getattr(helper, "__wrapped__", helper))
    with single_rank_process_group():
        assert gloo_worker_threads() == 2  # torch's default: what the workaround changes
    use_one_gloo_worker_thread()
    use_one_gloo_worker_thread()  # twice is once
    with single_rank_process_group():
        group = dist.new_group([0])
        assert gloo_worker_threads() == gloo_worker_threads(group) == 1
        assert c10d.ProcessGroupGloo is dist.ProcessGroupGloo
        for g in (None, group):
            set_process_group_timeout(g, 123)
            assert process_group_timeout_seconds(g) == 123.0
        tensor = torch.ones(3)
        dist.all_reduce(tensor, group=group)
        assert tensor.tolist() == [1.0, 1.0, 1.0]
