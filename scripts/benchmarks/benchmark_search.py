"""The layout search on the three published cases, timed, with its top rows checked against standalone dry runs.

    python scripts/benchmarks/benchmark_search.py            # ~15 minutes on 2 CPU cores (check `uptime` first: alone)
    python scripts/benchmarks/benchmark_search.py --cases 8b # one case

For 8B on 8, 70B on 256 and 405B on 512 H100s (the published layouts of TorchTitan's runs as the config: docs/
dry_run.md), runs ``train.py --dry_run --dry_run.search`` as a user would, measures its wall time, runs the
top 3 rows and the config's own layout as standalone dry runs and checks they print the same numbers, and
writes the tables between the search markers of docs/dry_run.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import harness

CASES = {
    "8b": ("Llama 3 8B on 8 H100s (SimpleFSDP's published 8B run: FSDP8, lbs 1, selective AC, compiled)",
           ["--config", "llama3_8b.toml", "--dry_run.world_size", "8"], 60),
    "70b": ("Llama 3 70B on 256 H100s (TorchTitan's published 70B run: FSDP32 x TP8, lbs 16, full AC, compiled; "
            "here in bf16 with async TP)",
            ["--config", "llama3_70b.toml", "--dry_run.world_size", "256", "--training.local_batch_size", "16",
             "--parallelism.enable_async_tensor_parallel"], 300),
    "405b": ("Llama 3 405B on 512 H100s (TorchTitan's published 405B run: FSDP8 x TP8 x PP8, Interleaved 1F1B, "
             "lbs 32 as 8 microbatches of 4, full AC, async TP; here in bf16)",
             ["--config", "llama3_405b.toml", "--dry_run.world_size", "512",
              "--parallelism.pipeline_parallel_microbatch_size", "4"], 600),
}
BEGIN = "<!-- layout search tables: begin (scripts/benchmarks/benchmark_search.py) -->"
END = "<!-- layout search tables: end -->"


def train(folder: Path, args: list[str]) -> harness.Job:
    """``train.py --dry_run`` as a user runs it (this environment as it is: every core)."""
    return harness.launch(harness.TRAIN, "--dry_run", "--job.dump_folder", folder, *args, env=os.environ)


def run_case(name: str) -> str:
    title, args, _ = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        search = train(Path(tmp) / "search", [*args, "--dry_run.search"]).check(f"{name}: the search")
        result = json.loads((Path(tmp) / "search" / "search.json").read_text())
        checks = []
        for index, row in enumerate([*result["table"][:3], result["published"]]):
            train(Path(tmp) / str(index), [*args, *row["overrides"]]).check(f"{name}: the dry run of row {index}")
            report = json.loads((Path(tmp) / str(index) / "dry_run.json").read_text())
            same = (report["memory_bytes"]["reserved"] / 2**30 == row["reserved_gib"]
                    and report["tokens_per_second_per_gpu"] == row["tokens_per_second_per_gpu"])
            checks.append("equal" if same else f"DIFFERENT ({report['tokens_per_second_per_gpu']:.1f})")
    table = search.stdout[search.stdout.index("layout search:"):].split("\n  written:")[0]
    table = re.sub(r"(the fastest, to paste: )(.*)", lambda m: m.group(1) + m.group(2)[:2000], table)
    phases = json.dumps({k: round(v, 1) for k, v in result["phase_seconds"].items()})
    return "\n".join([
        f"### {title}", "",
        f"`python train.py {' '.join(args)} --dry_run --dry_run.search`: **{search.seconds:.0f} s** wall on this "
        f"2-core CPU (the budget is a count of layouts, so the time follows the machine's load; phases {phases}).",
        f"Top 3 rows and the config's layout as standalone dry runs: {', '.join(checks)}.", "",
        "```", table, "```", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/dry_run.md as it is")
    options = parser.parse_args()
    sections = []
    for name in options.cases:
        section = run_case(name)
        print(section, flush=True)
        sections.append(section)
    if options.no_docs or options.cases != list(CASES):
        return
    docs = harness.DOCS / "dry_run.md"
    harness.write_block(docs, BEGIN, END, "\n".join(["", *sections]))
    print(f"written: {docs}")


if __name__ == "__main__":
    main()
