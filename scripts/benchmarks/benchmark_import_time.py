"""What an eager rank spends importing: this checkout against another revision, interleaved in one run.

    .venv/bin/python scripts/benchmarks/benchmark_import_time.py --before 09f6330 --runs 7

Each run is a fresh ``python`` process that imports what ``train.py`` imports for an eager job (the trainer, the
assembly, the data pipeline) and reports the wall and CPU seconds of those imports and whether Inductor's
compiler (``torch._inductor.compile_fx``) was loaded. The two checkouts alternate run by run (the other one is a
temporary git worktree), so a change of the machine's load touches both; medians are reported. Run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import harness

PROBE = """
import json, resource, sys, time
start, cpu0 = time.perf_counter(), time.process_time()
import titan_simple.trainer.trainer, titan_simple.core.assemble, titan_simple.data
print(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu0,
                  "inductor_compiler": "torch._inductor.compile_fx" in sys.modules}))
"""


def measure(checkout: Path) -> dict:
    job = harness.launch("-c", PROBE, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}, cwd=checkout)
    return job.check(f"the import probe in {checkout}").last_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the revision to compare with (a commit or branch)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="import_time_") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=harness.REPO,
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            measure(harness.REPO), measure(before)  # warm the page cache for both
            for _ in range(args.runs):
                runs["before"].append(measure(before))
                runs["after"].append(measure(harness.REPO))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=harness.REPO, check=True)
    print(f"| checkout | import wall s (median of {args.runs}) | import CPU s | Inductor's compiler loaded |")
    print("|---|---:|---:|---|")
    for name, label in (("before", args.before), ("after", "this checkout")):
        rows = runs[name]
        print(f"| {label} | {statistics.median(r['wall'] for r in rows):.2f} | "
              f"{statistics.median(r['cpu'] for r in rows):.2f} | {rows[0]['inductor_compiler']} |")


if __name__ == "__main__":
    main()
