import os
import tempfile

# Nothing may come from the Hugging Face Hub: the project reads only local files and packaged corpora.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Compiled graphs are not reused across tests: a test of our post-grad pass (bucketing, reordering, the comm plan)
# must see the pass run, and a graph loaded from torch's cache skips it. The tests of the compile cache itself
# (tests/test_compile_cache.py) switch these back on for their runs. Kernels are still shared through one
# folder for the whole suite (an explicit TORCHINDUCTOR_CACHE_DIR wins over [compile] cache_dir, whose default
# under each test's dump folder would build them again for every test).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "titan_simple_tests_inductor"))
