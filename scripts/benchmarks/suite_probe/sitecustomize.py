"""The suite probe's per-process half (scripts/benchmarks/profile_suite.sh puts this folder on PYTHONPATH, so every
Python process of the run imports it at start-up). With ``TITAN_SUITE_PROBE`` set to a folder it appends to two
logs there, each line tagged with the test that was running (pytest's ``PYTEST_CURRENT_TEST``, which every child
inherits):

* ``launches.log``: one line per interpreter started (pid, parent pid, what it runs): torchrun, its ranks,
  train.py, scripts, Inductor's compile workers. Ranks forked from the suite's forkserver start no interpreter
  and are not in it.
* ``compiles.log``: one line per torch.compile of a frame (Dynamo, AOT autograd, Inductor, the C++ compiles it
  waits for), and per lazily compiled backward: start and end times from torch's compile callbacks.

Without the variable it does nothing. It imports nothing heavy: the compile hook is installed when torch's own
``torch._dynamo.callback`` module is imported, by patching its handler's class (``torch._dynamo.reset()`` clears
the registered callbacks, not the class).
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_FOLDER = os.environ.get("TITAN_SUITE_PROBE")


def _test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "none").replace("\n", " ")


def _append(name: str, line: str) -> None:
    try:
        with open(os.path.join(_FOLDER, name), "a") as out:
            out.write(line + "\n")
    except OSError:
        pass


def _patch_callbacks(module) -> None:
    handler_class = module.CompilationCallbackHandler
    run_start, run_end = handler_class.run_start_callbacks, handler_class.run_end_callbacks
    started: dict[int, float] = {}

    def run_start_callbacks(self, args):
        started[id(self)] = time.time()
        return run_start(self, args)

    def run_end_callbacks(self, args):
        start = started.pop(id(self), None)
        if start is not None:
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "?")
            _append("compiles.log", f"{start:.3f} {time.time():.3f} {os.getpid()} {trigger} {_test()}")
        return run_end(self, args)

    handler_class.run_start_callbacks = run_start_callbacks
    handler_class.run_end_callbacks = run_end_callbacks


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch._dynamo.callback`` so the patch runs after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo.callback":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_callbacks(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _command() -> str:
    """What this process runs: its argv, and for ``python -c CODE`` the code's start (sys.argv holds only "-c")."""
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")[1:]
    except OSError:
        words = []
    text = " ".join(w.decode(errors="replace") for w in words).replace("\n", " ").replace("\t", " ")
    return text[:160] or " ".join(sys.argv[:4])


if _FOLDER:
    _append("launches.log", f"{time.time():.3f} {os.getpid()} {os.getppid()} {_test()}\t{_command()}")
    sys.meta_path.insert(0, _PatchOnImport())
