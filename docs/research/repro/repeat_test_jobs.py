"""Run the compiled multi-process test jobs that used to retry an abort again and again, and count the runs that
crash (issue 30).

Each job is what a test module's fixture hands ``tests.distributed_utils.run_on_ranks``: the same function, world
size and arguments, so the same processes, layouts and steps. A run fails when a rank raises or dies (abort,
segfault, hang past the timeout); the numbers the tests assert are the tests' business, not this script's.
Rounds go over every job in turn, so a partial run still covers each job evenly.

With ``--warm-cache`` (the default) Inductor's FX graph and AOT autograd caches are on in a folder of this run:
the first round compiles, the later ones load the compiled code (as a restarted job would), so a round costs
processes and steps, not compilation. The gloo race this checks for (docs/research/upstream_gloo_worker_thread_race.md)
is in the collectives the steps issue, not in compilation; a cached graph skips our post-grad pass (its comm plan
is restored from the cache), so later rounds run less compile-time code than the tests do. A continued run
(``--scratch``) appends to ``results.jsonl`` with its rounds numbered from 1 again.

    .venv/bin/python docs/research/repro/repeat_test_jobs.py --runs 20 --out outputs/repeat_test_jobs
    .venv/bin/python docs/research/repro/repeat_test_jobs.py --runs 3 --jobs pipeline_2,tensor_parallel_4
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parents[2]


def jobs(scratch: str) -> dict[str, tuple[Callable[..., Any], int, tuple]]:
    """name -> (function, world size, arguments), as each test module's fixture calls run_on_ranks."""
    t = {name: importlib.import_module(f"tests.test_{name}") for name in (
        "async_tensor_parallel", "compile", "compile_isolation", "composition", "pipeline", "regional_compile",
        "simple_fsdp_llama", "step_gather", "tensor_parallel")}
    dump = f"--job.dump_folder={scratch}/tp_dump"
    tp_configs = {name: ((*args, dump), steps, inspect)
                  for name, (args, steps, inspect) in t["tensor_parallel"].FOUR_RANK_CONFIGS.items()}
    sg = t["step_gather"]
    accumulation = ("--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=1",
                    "--training.global_batch_size=8")
    pipelined = ("--parallelism.data_parallel_shard_degree=2", "--parallelism.pipeline_parallel_degree=2",
                 "--parallelism.pipeline_parallel_schedule=1F1B", "--training.local_batch_size=8",
                 "--parallelism.pipeline_parallel_microbatch_size=1")
    compile_settings = [("none", False), ("none", True), ("transformer_block", False), ("transformer_block", True),
                        ("auto", True)]
    return {
        "async_tensor_parallel_2": (t["async_tensor_parallel"]._compiled_graph_matches, 2, ()),
        "compile_2": (t["compile"]._train_settings, 2, (compile_settings, f"{scratch}/compile")),
        "compile_isolation_4": (t["compile_isolation"]._compile_every_setting, 4, ()),
        "composition_4": (t["composition"]._run_configs, 4, (t["composition"].FOUR_RANK_CONFIGS,)),
        "composition_8": (t["composition"]._run_configs, 8, (t["composition"].EIGHT_RANK_CONFIGS,)),
        "pipeline_2": (t["pipeline"]._run_configs, 2, (t["pipeline"].TWO_RANK_CONFIGS, f"{scratch}/pp_trainer")),
        "pipeline_4": (t["pipeline"]._run_configs, 4, (t["pipeline"].FOUR_RANK_CONFIGS,)),
        "regional_compile_2": (t["regional_compile"]._train, 2, ()),
        "simple_fsdp_llama_2": (t["simple_fsdp_llama"]._run_configs, 2, (t["simple_fsdp_llama"].TWO_RANK_CONFIGS,)),
        "simple_fsdp_llama_4": (t["simple_fsdp_llama"]._run_configs, 4, (t["simple_fsdp_llama"].FOUR_RANK_CONFIGS,)),
        "step_gather_2": (sg._run, 2, (sg.ACCUMULATION, accumulation, 4, sg.CASES)),
        "step_gather_4": (sg._run, 4, (sg.PIPELINE, pipelined, 1, sg.CASES)),
        "tensor_parallel_4": (t["tensor_parallel"]._run_configs, 4, (tp_configs,)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="rounds over the jobs")
    parser.add_argument("--jobs", default="", help="comma list of job names (default: all)")
    parser.add_argument("--out", default="outputs/repeat_test_jobs", help="folder for results.jsonl")
    parser.add_argument("--cold-cache", action="store_true", help="compile in every run (no FX graph cache)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as hung")
    parser.add_argument("--scratch", default=None,
                        help="folder for the compile cache and the jobs' files (default: a new one); an earlier "
                             "run's folder continues with its cache warm")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or tempfile.mkdtemp(prefix="repeat_test_jobs_")
    print(f"scratch folder: {scratch}", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cache = "0" if args.cold_cache else "1"
    os.environ.update(TORCHINDUCTOR_FX_GRAPH_CACHE=cache, TORCHINDUCTOR_AUTOGRAD_CACHE=cache,
                      TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / "inductor"))
    sys.path.insert(0, str(PROJECT_DIR))
    from tests.distributed_utils import run_on_ranks

    table = jobs(scratch)
    names = [n for n in args.jobs.split(",") if n] or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        parser.error(f"unknown jobs {unknown}; choose from {sorted(table)}")
    failures: dict[str, int] = dict.fromkeys(names, 0)
    with open(out / "results.jsonl", "a") as log:  # appended: a continued run adds its rounds
        for run in range(1, args.runs + 1):
            for name in names:
                fn, world, fn_args = table[name]
                start = time.perf_counter()
                try:
                    run_on_ranks(fn, world, args=fn_args, timeout_s=args.timeout)
                    ok, error = True, ""
                except Exception:  # noqa: BLE001 -- a failing run is what this script counts
                    ok, error = False, traceback.format_exc()[-4000:]
                    failures[name] += 1
                seconds = time.perf_counter() - start
                record = {"job": name, "run": run, "ok": ok, "seconds": round(seconds, 1), "error": error}
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"run {run} {name}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)", flush=True)
                if error:
                    print(error, flush=True)
    print("failed runs per job:", json.dumps(failures))
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
