"""The suite probe's pytest half (``-p suite_probe_plugin``, scripts/benchmarks/profile_suite.sh): for every test,
its wall seconds and the CPU-seconds the whole machine was busy meanwhile (``/proc/stat``: on a quiet machine the
suite's processes, forked ranks and compile workers included, which a process's own rusage does not all count),
appended to ``$TITAN_SUITE_PROBE/tests.log`` as ``nodeid<TAB>wall<TAB>busy``; setup and teardown included (a
module fixture's job is paid by the first test that uses it)."""

import os
import time

import pytest


def _busy_cpu_seconds() -> float:
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start_wall, start_busy = time.time(), _busy_cpu_seconds()
    yield
    folder = os.environ.get("TITAN_SUITE_PROBE")
    if folder:
        with open(os.path.join(folder, "tests.log"), "a") as out:
            out.write(f"{item.nodeid}\t{time.time() - start_wall:.2f}\t{_busy_cpu_seconds() - start_busy:.2f}\n")
