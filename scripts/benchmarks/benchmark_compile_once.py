"""Compile once against every rank compiling, and a precompiled start: 4-rank compiled jobs of the debug model.

    .venv/bin/python scripts/benchmarks/benchmark_compile_once.py            # fully_shard and dp2 x pp2, ~20 min
    .venv/bin/python scripts/benchmarks/benchmark_compile_once.py --doc      # and write the table into docs/

Each job runs 2 steps, in its own cold compile cache folder (``[compile] cache_dir``; no
``TORCHINDUCTOR_CACHE_DIR``), three ways one after another: every rank compiles (``compile_on_one_rank = false``,
what every job did before), one rank compiles and the others load (the default), and precompiled (``train.py
--compile.precompile_world_size 4`` from one process first, its time reported apart; not for pipeline parallel,
which the precompile refuses). Measured per rank by a
wrapper around the trainer: the CPU seconds from the start of the training loop to the end of step 1, minus those
of step 2 (what compiling added to the first step: Dynamo, AOT autograd, Inductor and the C++ compiler, which
runs in Inductor's compile workers, counted from /proc as descendants of the rank), summed over the 4 ranks;
and the wall time from launch to the end of step 1 on rank 0. Losses and gradient norms of every mode must be
bitwise equal. Run it on a quiet machine: another job on the cores changes every time here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

DOC = harness.DOCS / "benchmarks.md"
BEGIN, END = "<!-- compile-once table -->", "<!-- /compile-once table -->"
BASE = ["--config", "llama3_debug.toml", "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32", "--compile.enable", "--lr_scheduler.warmup_steps", "1"]
LAYOUTS = {
    "fully_shard": [],
    "dp2 x pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
}
MODES = {"every rank compiles": ["--compile.compile_on_one_rank", "false"], "one rank compiles": [],
         "precompiled": []}


def worker_main() -> None:
    """Under torchrun: the trainer, with each step's end timed (CPU seconds of this process and its waited-for
    children, and the wall clock), written to $BENCH_OUT/rank<r>.json."""
    from titan_simple.config import load_job_config
    from titan_simple.trainer.distributed import shutdown_distributed
    from titan_simple.trainer.trainer import Trainer

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + descendants_cpu(os.getpid())

    marks: dict[str, tuple[float, float]] = {}
    record, train = Trainer._record, Trainer.train

    def timed_record(self, result, timer):
        marks[f"step{self.global_step}"] = (cpu(), time.time())
        return record(self, result, timer)

    def timed_train(self):
        marks["train"] = (cpu(), time.time())
        return train(self)

    Trainer._record, Trainer.train = timed_record, timed_train
    logging.basicConfig(level=logging.INFO if os.environ["RANK"] == "0" else logging.ERROR)  # as train.py
    trainer = Trainer(load_job_config(sys.argv[1:]))
    trainer.train()
    shutdown_distributed()
    from titan_simple.compile.once import active_session

    session = active_session()
    rank = int(os.environ["RANK"])
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_text(
        json.dumps({**marks, "leads": bool(session and session.leads)}))


def descendants_cpu(pid: int) -> float:
    """CPU seconds of the live descendants of ``pid`` (Inductor's compile workers) and of the children they have
    waited for (the C++ compiler), from /proc: a rank's own rusage counts only the children it waited for."""
    parents, times = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    below, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return sum(times[p] for p in below) / os.sysconf("SC_CLK_TCK")


def run_job(layout: str, mode: str, root: Path, steps: int = 2) -> dict:
    from titan_simple.trainer.metrics import TOKENS_PER_SECOND

    folder = root / f"{layout.replace(' ', '')}-{mode.split()[0]}"
    cache = folder / "compile_cache"
    # no rank finds another's graph in the cache when every rank compiles: each compiles all of them
    no_cache = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    env = harness.benchmark_env(drop=("TORCHINDUCTOR_CACHE_DIR",), BENCH_OUT=str(folder),
                                **(no_cache if mode == "every rank compiles" else {}))
    args = [*BASE, "--training.steps", str(steps), *LAYOUTS[layout], *MODES[mode],
            "--job.dump_folder", str(folder / "dump"), "--compile.cache_dir", str(cache)]
    folder.mkdir(parents=True)
    precompile_seconds = None
    if mode == "precompiled":
        precompile = harness.launch(harness.TRAIN, *args, "--compile.precompile_world_size", "4", env=env)
        precompile_seconds = precompile.check(f"{layout} / precompiling").seconds
    job = harness.launch(Path(__file__).resolve(), "--worker", *args, nproc=4, env=env).check(f"{layout} / {mode}")
    marks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(4)]
    compile_cpu = [(m["step1"][0] - m["train"][0]) - (m["step2"][0] - m["step1"][0]) for m in marks]
    metrics = harness.read_metrics(folder / "dump")
    summary = [line.split("compile once ", 1)[1] for line in job.output.splitlines() if "compile once (" in line]
    return {"layout": layout, "mode": mode, "compile_cpu": compile_cpu, "leads": [m["leads"] for m in marks],
            "step1_wall": marks[0]["step1"][1] - job.started,
            "losses": [(r["loss_metrics/global_avg_loss"], r["grad_norm"]) for r in metrics],
            # steady state, after the compiling step and the one after it: the compiled code each mode runs
            "tokens_per_second": statistics.median(r[TOKENS_PER_SECOND] for r in metrics[2:]) if steps > 2 else None,
            "precompile_seconds": precompile_seconds, "summary": summary[0] if summary else ""}


def table(results: list[dict]) -> list[str]:
    """One row per job. "x each graph once": the CPU-seconds summed over the ranks over those of the ranks that
    compiled each class's graphs alone (the leaders of "one rank compiles": what compiling every distinct graph
    exactly once costs on this machine)."""
    lines = ["| layout | mode | compile CPU-s, 4 ranks (per rank) | x each graph once | launch to end of step 1 | "
             "vs every rank | losses | tokens/s per rank, steps 3+ |", "|---|---|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        rows = [r for r in results if r["layout"] == layout]
        once = [r for r in rows if r["mode"] == "one rank compiles"]
        if not rows or not once:
            continue
        every = rows[0]
        each_once = sum(c for c, leads in zip(once[0]["compile_cpu"], once[0]["leads"], strict=True) if leads)
        for r in rows:
            pre = f" (+{r['precompile_seconds']:.0f} s precompiling)" if r["precompile_seconds"] else ""
            same = "bitwise equal" if r["losses"] == every["losses"] else "DIFFER"
            lines.append(f"| {layout} | {r['mode']} | {sum(r['compile_cpu']):.1f} "
                         f"({', '.join(f'{c:.1f}' for c in r['compile_cpu'])}) | "
                         f"{sum(r['compile_cpu']) / each_once:.2f} | {r['step1_wall']:.1f} s{pre} | "
                         f"{r['step1_wall'] / every['step1_wall'] - 1:+.0%} | {same} | "
                         f"{r['tokens_per_second'] or 0:,.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2,
                        help="steps per job; above 2, the median tokens/s of steps 3+ (steady state) is reported")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="compile_once_") as root:
        for layout in args.layouts.split(","):
            for mode in MODES:
                if mode == "precompiled" and "pp" in layout:  # not precompiled (trainer/precompile.py says why)
                    continue
                results.append(run_job(layout, mode, Path(root), args.steps))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    lines = [f"Load average at the start: {load:.2f}.", "", *table(results), ""]
    lines += [f"- {r['layout']}, {r['mode']}: `compile once {r['summary']}`" for r in results if r["summary"]]
    print("\n".join(lines))
    if args.doc:
        harness.write_block(DOC, BEGIN, END, "\n".join(lines))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker_main()
    else:
        main()
