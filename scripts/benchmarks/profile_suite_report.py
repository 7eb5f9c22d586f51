"""The table of ``profile_suite.sh``: per test file, pytest's seconds and the C++ compiles its tests ran (count,
seconds summed), and for the run the CPU-seconds the machine was busy.

    .venv/bin/python scripts/benchmarks/profile_suite_report.py outputs/profile_suite
"""

from __future__ import annotations

import argparse
import collections
import re
import xml.etree.ElementTree as ET
from pathlib import Path


def busy_cpu_seconds(folder: Path) -> tuple[float, float]:
    """(busy, total) CPU-seconds of the machine between the run's two /proc/stat readings (all cores)."""
    start, end = ([int(v) for v in (folder / name).read_text().split()[1:9]] for name in ("procstat.start",
                                                                                         "procstat.end"))
    delta = [b - a for a, b in zip(start, end, strict=True)]
    idle = delta[3] + delta[4]  # idle, iowait
    return (sum(delta) - idle) / 100, sum(delta) / 100  # USER_HZ is 100 on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    per_file: dict[str, float] = collections.Counter()
    for case in ET.parse(folder / "suite.xml").iter("testcase"):
        per_file[case.get("classname").split(".")[-1] + ".py"] += float(case.get("time"))
    compiles: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    log = folder / "gxx.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        start, end, test = line.split(" ", 2)
        name = re.sub(r" \((setup|call|teardown)\)$", "", test).split("::")[0].split("/")[-1]
        compiles[name][0] += 1
        compiles[name][1] += float(end) - float(start)
    busy, total = busy_cpu_seconds(folder)
    print(f"CPU busy {busy:.0f} of {total:.0f} CPU-s ({busy / total:.0%}); C++ compiles "
          f"{sum(c[0] for c in compiles.values()):.0f}, {sum(c[1] for c in compiles.values()):.0f} s")
    print("| file | pytest s | C++ compiles (count, s) |\n|---|---:|---:|")
    for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        count, compile_seconds = compiles.get(name, (0, 0.0))
        print(f"| {name} | {seconds:.0f} | {count:.0f}, {compile_seconds:.0f} |")


if __name__ == "__main__":
    main()
