"""The suite's environment (set before anything imports torch) and the fixtures several test files share; the
helpers they share are in tests/harness.py."""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import train_compiled

# Nothing may come from the Hugging Face Hub: the project reads only local files and packaged corpora.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A single process's compiled graphs are not reused across tests: a test of our post-grad pass (bucketing,
# reordering, the comm plan) must see the pass run, and a graph loaded from torch's cache skips it. The FX graph
# cache is off by default (TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT: a default, which a config patch overrides, not
# TORCHINDUCTOR_FX_GRAPH_CACHE, which would win over it), and AOT autograd's cache saves nothing without it. A
# multi-rank compiled job compiles once (compile/once.py): it turns both caches on for its compiles, its leader
# compiles into the suite's folder and the other ranks load, so a later job of the same graphs loads them too,
# its comm plan read back from the copy the compiling job kept (compile/cache.py). The tests of the compile cache
# itself (tests/test_compile_cache.py, tests/test_compile_once.py) use folders of their own. Kernels are shared
# through one folder for the whole suite (an explicit TORCHINDUCTOR_CACHE_DIR wins over [compile] cache_dir, whose
# default under each test's dump folder would build them again for every test).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "titan_simple_tests_inductor"))


@pytest.fixture(scope="session")
def compiled_job(tmp_path_factory) -> tuple[Path, str]:
    """(dump folder, output) of the 2-rank compiled job that tests/test_compile_cache.py and
    tests/test_compile_once.py both start from, run once for the session: ``COMPILED_JOB`` for 3 steps, compiled
    once (the default), a checkpoint every 2 steps and at the last, its graphs in the default cache folder under the
    dump (``<dump>/compile_cache``), torch's caches on. A test that changes what it left works on a copy."""
    dump = tmp_path_factory.mktemp("compiled_job") / "dump"
    return dump, train_compiled(dump, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "2")



# The suite runs in two pytest workers (pyproject.toml: -n 2), each with its own pool of worlds. A file whose jobs
# keep both cores busy by themselves (``BOTH_CORES``: under a quarter of the cores idle in the per-file table of
# docs/benchmarks.md) runs alone: it holds the run's lock exclusively, the other worker waits. The other files hold
# it shared, two at a time, so one file's idle core (a launch's start, a one-process reference, a follower rank
# waiting for its leader's compile) runs the other's work. The files with both cores busy go first, then the
# others, heaviest first (a file not named below comes last, in collection order). A file's tests go to one worker,
# so its module fixtures (its shared jobs) run once; files that share a session fixture go to one worker too.
BOTH_CORES = (
    "test_shipped_configs.py", "test_fault_tolerance.py", "test_context_parallel.py", "test_dry_run_search.py",
    "test_document_masking.py", "test_activation_checkpoint_compiled.py", "test_stages_training.py", "test_compile.py",
    "test_float8_gather.py", "test_composition.py", "test_float8.py", "test_simple_fsdp.py", "test_pipeline.py",
    "test_regional_compile.py", "test_simple_fsdp_llama.py", "test_tensor_parallel.py", "test_checkpoint.py",
    "test_fsdp_gather.py",
)
HEAVIEST_FIRST = (
    *BOTH_CORES, "test_compile_cache.py", "test_compile_once.py", "test_compile_isolation.py", "test_job_pool.py",
    "test_gpu_check.py", "test_run_status.py", "test_activation_checkpoint.py", "test_first_hour.py",
    "test_async_tensor_parallel.py", "test_tied_embeddings.py", "test_multinode.py", "test_muon_sharded.py",
    "test_dry_run.py",
)
SAME_WORKER = {"test_compile_once.py": "test_compile_cache.py"}  # both start from the session's compiled_job


def pytest_collection_modifyitems(config, items) -> None:
    """Heaviest files first (stable: a file's tests keep their order); every worker collects the same order."""
    rank = {name: index for index, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's file scheduling, with the files of ``SAME_WORKER`` one unit, in the order collected."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            name = path.rsplit("/", 1)[-1]
            return path.replace(name, SAME_WORKER[name]) if name in SAME_WORKER else path

    config.option.loadscopereorder = False  # keep the heaviest-first order rather than the most tests first
    return FileScheduling(config, log)


@pytest.fixture(scope="module", autouse=True)
def _cores_for_this_file(request) -> Iterator[None]:
    """Under pytest-xdist, the run's lock for the file's tests and module fixtures: exclusive for ``BOTH_CORES``,
    shared for the others (``flock``: released when the file closes, also when a worker dies)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    import fcntl

    with open(Path(tempfile.gettempdir()) / f"titan_simple_tests_{run}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if request.path.name in BOTH_CORES else fcntl.LOCK_SH)
        yield


def pytest_sessionfinish(session, exitstatus) -> None:
    """The pool's worlds (tests/job_pool.py) end with the session."""
    import sys

    pool = sys.modules.get("tests.job_pool")
    if pool is not None:
        pool.shutdown()
