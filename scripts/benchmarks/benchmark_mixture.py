"""A mixture of three large sources: tokenizing each, blending them, and the data's share of a training step.

    .venv/bin/python scripts/benchmarks/benchmark_mixture.py --doc   # ~8 min on 2 cores, a quiet machine
    .venv/bin/python scripts/benchmarks/benchmark_mixture.py --mb 16  # a quick look

Three jsonl corpora of ``--mb`` each (benchmark_data.py's Shakespeare passages; each corpus its own copy numbers,
so no two documents are equal), each in its own process:

* **tokenizing**: each source's token store built from scratch with 2 processes (time, tokens/s, peak RSS);
* **blending**: the three stores opened and blended 0.5 / 0.3 / 0.2 at seq_len 2048, then 20,000 global samples
  read (what 20 steps of a 1,000-sequence batch read): the time to open and blend, per sample, and peak RSS;
* **training**: the debug model on 2 processes, 20 steps of 8 x 2048 tokens per rank, from the mixture and from
  the first source alone: the trainer's own ``time_metrics/data_loading(%)`` and peak RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import harness
from benchmark_data import TOKENIZER, make_corpus, run_build, run_training

DOC = harness.DOCS / "benchmarks.md"
MARKERS = ("<!-- mixture table -->", "<!-- /mixture table -->")
NAMES, WEIGHTS = ("first", "second", "third"), (0.5, 0.3, 0.2)
SEQ_LEN, SAMPLES = 2048, 20_000


def blend_once(folders: list[str], cache: str) -> dict:
    """Worker: open the three built stores, blend them and read ``SAMPLES`` samples (run in a fresh process)."""
    from types import SimpleNamespace

    from titan_simple.data.datasets import mixture_index
    from titan_simple.data.tokenizer import Tokenizer

    mixture = [SimpleNamespace(name=n, dataset="json", dataset_path=f, weight=w)
               for n, f, w in zip(NAMES, folders, WEIGHTS, strict=True)]
    started = time.perf_counter()
    index = mixture_index(mixture, tokenizer=Tokenizer(str(TOKENIZER)), seq_len=SEQ_LEN, split="train",
                          shuffle_seed=0, cache=Path(cache))
    opened = time.perf_counter() - started
    started = time.perf_counter()
    for g in range(SAMPLES):
        index.sample(g)
    read = time.perf_counter() - started
    return {"open_s": opened, "per_sample_us": read / SAMPLES * 1e6, "period": index.period,
            "taken": index.taken(SAMPLES), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/titan_simple_benchmark_mixture")
    parser.add_argument("--mb", type=int, default=256, help="megabytes of jsonl per source")
    parser.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--worker-blend", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_blend:
        print(json.dumps(blend_once(json.loads(args.worker_blend[0]), args.worker_blend[1])))
        return 0
    work, load = Path(args.work), os.getloadavg()[0]
    print(f"load average before: {load:.2f}")
    cache = work / "cache"
    folders = []
    builds = []
    for number, name in enumerate(NAMES):
        corpus = make_corpus(work / f"{name}_{args.mb}mb", args.mb, first_copy=number * 10**9)
        folders.append(str(work / f"{name}_{args.mb}mb"))
        builds.append(run_build(corpus, work / f"cache_{name}", 2))
    # the training and the blend read one cache holding all three stores
    cache.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        for store in (work / f"cache_{name}").iterdir():
            target = cache / store.name
            if not target.exists():
                os.symlink(store, target)
    blend = harness.launch(Path(__file__).resolve(), "--worker-blend", json.dumps(folders), cache)
    blended = blend.check("blending").last_json()
    mixture = "[" + ", ".join(f'{{name = "{n}", dataset = "json", dataset_path = "{f}", weight = {w}}}'
                              for n, f, w in zip(NAMES, folders, WEIGHTS, strict=True)) + "]"
    trainings = [run_training("the mixture of three", work / "dump_mixture", cache, "--training.mixture", mixture),
                 run_training("the first source alone", work / "dump_single", cache, "--training.dataset", "json",
                              "--training.dataset_path", folders[0])]
    text = table(builds, blended, trainings, args.mb)
    print(text)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.doc:
        harness.write_block(DOC, *MARKERS, text)
    return 0


def table(builds: list[dict], blended: dict, trainings: list[dict], mb: int) -> str:
    rows = ["| what | measured |", "|---|---|"]
    for name, b in zip(NAMES, builds, strict=True):
        rows.append(f"| tokenize source '{name}' ({b['bytes'] / 2**20:.0f} MiB jsonl, 2 processes) | "
                    f"{b['tokens']:,} tokens in {b['seconds']:.1f} s ({b['tokens'] / b['seconds']:,.0f} tokens/s), "
                    f"peak RSS {b['peak_rss_mib']:.0f} MiB (workers {b['worker_peak_rss_mib']:.0f} MiB) |")
    rows.append(f"| open and blend the three (0.5 / 0.3 / 0.2, seq_len {SEQ_LEN}) | {blended['open_s'] * 1e3:.1f} ms, "
                f"period {blended['period']} samples, peak RSS {blended['peak_rss_mib']:.0f} MiB |")
    rows.append(f"| read {SAMPLES:,} global samples | {blended['per_sample_us']:.1f} us per sample; per source "
                f"{', '.join(f'{t:,}' for t in blended['taken'])} |")
    for t in trainings:
        rows.append(f"| train from {t['name']} (debug model, 2 processes, 8 x {SEQ_LEN} tokens per rank) | data "
                    f"{t['data_percent']:.2f}% of the step, peak RSS {t['peak_rss_gib']:.3f} GiB per rank |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
