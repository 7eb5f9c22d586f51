"""Time to the first step against depth, cold and warm: what compiling costs a start and a restart.

    .venv/bin/python scripts/benchmarks/benchmark_compile.py --doc  # 6, 12, 24, 48 blocks; ~25 min on 2 cores
    .venv/bin/python scripts/benchmarks/benchmark_compile.py --depths 6,24 --out /tmp/compile_bench

For each depth (``--model.n_layers`` on the debug model) five fresh ``torchrun --nproc_per_node=2 train.py``
jobs run one after the other on this machine (check that it is quiet first: another job on the 2 cores slows
every row): **cold** (a new compile cache folder: torch traces, compiles every graph and builds every kernel),
**warm** (the same command again, the same dump folder: what a restart or a resumed run does) and **eager**
(no compile, the reference), and the two compiled starts again with ``--compile.regional`` (one code for every
block). Every job trains one step of the default job's shape (local batch 4 x 128, the
trainer's own step, compiled with the shipped settings: transformer_block bucketing + reorder).

Measured on rank 0 (this file's ``--worker`` mode runs the real ``Trainer``): seconds from the end of the
build (the ``built:`` log line) to the end of step 1, and how torch's own compile timers split it:

* **tracing**: Dynamo's bytecode tracing (``bytecode_tracing``);
* **AOT autograd**: metadata, the joint forward/backward trace, joint-graph passes and the partitioner;
* **Inductor**: ``fx_codegen_and_compile`` of the forward and backward graphs (post-grad passes, ours
  included, lowering, code generation and the kernel builds it waits for);
* **cache load**: loading compiled graphs from the compile cache (``AOTAutogradCache.inductor_load``);
* **rest**: the step itself and whatever else precedes it (the difference).

The table goes to docs/benchmarks.md between ``<!-- benchmark_compile.py: begin/end -->`` with ``--doc``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import harness

DOC = harness.DOCS / "benchmarks.md"
BEGIN, END = "<!-- benchmark_compile.py: begin -->", "<!-- benchmark_compile.py: end -->"
JOB = ["--config", "llama3_debug.toml", "--training.steps", "1", "--metrics.log_freq", "1",
       "--lr_scheduler.warmup_steps", "1"]
# torch's compile timers (torch._dynamo.utils.compile_times) summed into the split; nested timers are not
# added twice (each group lists disjoint ones).
SPLIT = {
    "tracing": ("bytecode_tracing",),
    "aot": ("aot_collect_metadata", "aot_trace_joint_graph", "_recursive_joint_graph_passes",
            "min_cut_rematerialization_partition"),
    "inductor": ("fx_codegen_and_compile",),
    "cache_load": ("AOTAutogradCache.inductor_load",),
}


def worker_main(argv: list[str]) -> None:
    """One rank of one job: build the Trainer, train its one step, write rank 0's figures to ``--result``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    args, overrides = parser.parse_known_args(argv)
    import torch

    from titan_simple.compile.inductor_private import compile_counters
    from titan_simple.config import load_job_config
    from titan_simple.trainer.distributed import shutdown_distributed
    from titan_simple.trainer.trainer import Trainer

    trainer = Trainer(load_job_config(overrides))
    built = time.perf_counter()
    trainer.train()
    to_step_1 = time.perf_counter() - built
    if int(os.environ.get("RANK", "0")) == 0:
        names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
        timers = {name: float(value) for name, value in zip(names, values, strict=True)}
        split = {group: sum(timers.get(name, 0.0) for name in members) for group, members in SPLIT.items()}
        split["rest"] = to_step_1 - sum(split.values())
        Path(args.result).write_text(json.dumps({"to_step_1_s": to_step_1, "split_s": split,
                                                 "graphs": compile_counters(), "torch": torch.__version__}))
    shutdown_distributed()


MODES = ("cold", "warm", "regional cold", "regional warm", "eager")


def run_job(depth: int, mode: str, dump: Path, out: Path) -> dict:
    """One ``torchrun`` job of ``depth`` blocks: ``[regional] cold`` / ``warm`` compile into ``dump``'s cache
    (the whole model, or regionally: ``--compile.regional``), or ``eager``."""
    tag = mode.replace(" ", "_")
    result = out / f"depth{depth}_{tag}.json"
    env = harness.benchmark_env(drop=("TORCHINDUCTOR_",))  # torch's default compile caches
    compile_args = [] if mode == "eager" else ["--compile.enable"]
    if "regional" in mode:
        compile_args.append("--compile.regional")
    job = harness.launch(Path(__file__).resolve(), "--worker", "--result", result, *JOB, "--model.n_layers",
                         str(depth), *compile_args, "--job.dump_folder", dump, nproc=2, env=env,
                         log=out / f"depth{depth}_{tag}.log").check(f"{depth} blocks, {mode}")
    figures = json.loads(result.read_text())
    figures["job_s"] = job.seconds
    return figures


def table(results: dict[int, dict[str, dict]]) -> str:
    fewest = min(results)
    rows = [f"| blocks | start | to step 1 (s) | vs the same start at {fewest} blocks | tracing | AOT autograd | "
            "Inductor | cache load | rest | graphs compiled / reused | whole job (s) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for depth, modes in sorted(results.items()):
        for mode in (m for m in MODES if m in modes):
            r, base = modes[mode], results[fewest][mode]["to_step_1_s"]
            s, g = r["split_s"], r["graphs"]
            rows.append(
                f"| {depth} | {mode} | {r['to_step_1_s']:.1f} | {r['to_step_1_s'] / base:.2f}x | {s['tracing']:.1f} | "
                f"{s['aot']:.1f} | {s['inductor']:.1f} | {s['cache_load']:.1f} | {s['rest']:.1f} | "
                f"{g['miss'] + g['bypass']} / {g['hit']} | {r['job_s']:.0f} |")
    return "\n".join(rows)


def driver_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="6,12,24,48", help="comma list of transformer block counts")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--out", default=None, help="folder for the jobs' dump folders, logs and results")
    parser.add_argument("--doc", action="store_true", help=f"rewrite the table in {DOC.relative_to(harness.REPO)}")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="benchmark_compile_"))
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[int, dict[str, dict]] = {}
    for depth in (int(d) for d in args.depths.split(",")):
        # cold and warm share a dump folder: its compile_cache is the restart's cache
        dumps = {"cold": "", "warm": "", "regional cold": "_regional", "regional warm": "_regional", "eager": "_eager"}
        results[depth] = {mode: run_job(depth, mode, out / f"depth{depth}{dumps[mode]}", out)
                          for mode in MODES if mode in args.modes.split(",")}
        print(f"{depth} blocks: " + ", ".join(f"{m} {r['to_step_1_s']:.1f} s" for m, r in results[depth].items()),
              flush=True)
    text = (f"Measured {started}, load average {load:.2f} at the start, torch "
            f"{next(iter(results[min(results)].values()))['torch']}, 2 processes (gloo), debug model (dim 256) with "
            f"`--model.n_layers` blocks, local batch 4 x 128; "
            "`python scripts/benchmarks/benchmark_compile.py --doc`.\n\n"
            + table(results))
    print(text)
    harness.save_json(out / "results.json", {str(k): v for k, v in results.items()})
    if args.doc:
        harness.write_block(DOC, BEGIN, END, text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
    else:
        driver_main(sys.argv[1:])
