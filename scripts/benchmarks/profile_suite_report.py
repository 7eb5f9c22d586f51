"""The tables of ``profile_suite.sh``: per test file and for the slowest tests, wall seconds, the CPU-seconds the
machine was busy meanwhile, Python processes started, Inductor's C++ compiles (count, seconds) and torch.compile's
seconds (Dynamo through Inductor, summed over the processes that compiled, C++ compiles they waited for
included; "Python-side" is that less the C++ seconds of the same tests); and for the run, the busy CPU-seconds.

    .venv/bin/python scripts/benchmarks/profile_suite_report.py OUT_DIR [--slowest 30] [--against OTHER_OUT_DIR]

``--against`` adds the other run's wall seconds per file and the change (a before / after table).
"""

from __future__ import annotations

import argparse
import collections
import re
from dataclasses import dataclass
from pathlib import Path


def busy_cpu_seconds(folder: Path) -> tuple[float, float]:
    """(busy, total) CPU-seconds of the machine between the run's two /proc/stat readings (all cores)."""
    start, end = ([int(v) for v in (folder / name).read_text().split()[1:9]] for name in ("procstat.start",
                                                                                         "procstat.end"))
    delta = [b - a for a, b in zip(start, end, strict=True)]
    idle = delta[3] + delta[4]  # idle, iowait
    return (sum(delta) - idle) / 100, sum(delta) / 100  # USER_HZ is 100 on Linux


@dataclass
class Cost:
    tests: int = 0
    wall: float = 0.0
    busy: float = 0.0
    launches: int = 0  # Python processes started (Inductor's dlopen probes, `python -c`, counted apart)
    probes: int = 0
    cxx: int = 0
    cxx_s: float = 0.0
    compile_s: float = 0.0

    @property
    def python_compile_s(self) -> float:
        return max(0.0, self.compile_s - self.cxx_s)


def _test_of(tag: str) -> str:
    """The test id of a PYTEST_CURRENT_TEST value (an id and phase: 'tests/test_loss.py::test_a[2] (call)')."""
    return re.sub(r" \((setup|call|teardown)\)$", "", tag.strip())


def _file_of(test: str) -> str:
    return test.split("::")[0].split("/")[-1]


def read_run(folder: Path) -> dict[str, Cost]:
    """Cost per test id."""
    costs: dict[str, Cost] = collections.defaultdict(Cost)
    for line in (folder / "tests.log").read_text().splitlines():
        test, wall, busy = line.split("\t")
        cost = costs[test]
        cost.tests, cost.wall, cost.busy = 1, cost.wall + float(wall), cost.busy + float(busy)
    for line in _lines(folder / "launches.log"):
        head, _, argv = line.partition("\t")
        test = _test_of(head.split(" ", 3)[3])
        if _is_probe(argv):
            costs[test].probes += 1
        else:
            costs[test].launches += 1
    for line in _lines(folder / "gxx.log"):
        start, end, test = line.split(" ", 2)
        costs[_test_of(test)].cxx += 1
        costs[_test_of(test)].cxx_s += float(end) - float(start)
    for line in _lines(folder / "compiles.log"):
        start, end, _pid, _trigger, test = line.split(" ", 4)
        costs[_test_of(test)].compile_s += float(end) - float(start)
    costs.pop("none", None)  # outside any test: the session's start
    return costs


def _is_probe(argv: str) -> bool:
    """Inductor's ``python -c`` dlopen probe of a vector ISA (no torch import: milliseconds), not a launch. An older
    probe logged only sys.argv, where every ``-c`` (forkservers too) reads "-c": counted as probes then."""
    return argv.startswith("-c") and ("cdll.LoadLibrary" in argv or argv.strip() == "-c")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def per_file(costs: dict[str, Cost]) -> dict[str, Cost]:
    files: dict[str, Cost] = collections.defaultdict(Cost)
    for test, cost in costs.items():
        total = files[_file_of(test)]
        for name in ("tests", "wall", "busy", "launches", "probes", "cxx", "cxx_s", "compile_s"):
            setattr(total, name, getattr(total, name) + getattr(cost, name))
    return files


def _row(name: str, cost: Cost) -> str:
    return (f"| {name} | {cost.wall:.0f} | {cost.busy:.0f} | {cost.launches} | {cost.cxx}, {cost.cxx_s:.0f} | "
            f"{cost.compile_s:.0f} | {cost.python_compile_s:.0f} |")


HEADER = ("| {what} | wall s | busy CPU-s | Python launches | C++ compiles (n, s) | torch.compile s | "
          "Python-side compile s |\n|---|---:|---:|---:|---:|---:|---:|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--slowest", type=int, default=30)
    parser.add_argument("--against", type=Path, help="another run's folder: its wall per file beside this one's")
    args = parser.parse_args()
    costs = read_run(args.folder)
    files = per_file(costs)
    busy, total = busy_cpu_seconds(args.folder) if (args.folder / "procstat.end").exists() else (0.0, 0.0)
    print(f"{sum(c.tests for c in files.values())} tests, {sum(c.wall for c in files.values()):.0f} s in tests; "
          f"machine busy {busy:.0f} of {total:.0f} CPU-s; {sum(c.launches for c in files.values())} Python "
          f"launches ({sum(c.probes for c in files.values())} `python -c` probes apart); C++ compiles "
          f"{sum(c.cxx for c in files.values())}, {sum(c.cxx_s for c in files.values()):.0f} s; torch.compile "
          f"{sum(c.compile_s for c in files.values()):.0f} s\n")
    other = per_file(read_run(args.against)) if args.against else None
    if other is None:
        print(HEADER.format(what="file"))
        for name, cost in sorted(files.items(), key=lambda kv: -kv[1].wall):
            print(_row(name, cost))
    else:
        print("| file | before s | after s | change s |\n|---|---:|---:|---:|")
        for name in sorted(set(files) | set(other), key=lambda n: -other.get(n, Cost()).wall):
            before, after = other.get(name, Cost()).wall, files.get(name, Cost()).wall
            print(f"| {name} | {before:.0f} | {after:.0f} | {after - before:+.0f} |")
    print(f"\nThe {args.slowest} slowest tests:\n")
    print(HEADER.format(what="test"))
    for name, cost in sorted(costs.items(), key=lambda kv: -kv[1].wall)[:args.slowest]:
        print(_row(name.replace("|", "/"), cost))


if __name__ == "__main__":
    main()
