"""The suite's environment (set before anything imports torch) and the fixtures several test files share; the
helpers they share are in tests/harness.py."""

import os
import tempfile
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



def pytest_sessionfinish(session, exitstatus) -> None:
    """The pool's worlds (tests/job_pool.py) end with the session."""
    import sys

    pool = sys.modules.get("tests.job_pool")
    if pool is not None:
        pool.shutdown()
