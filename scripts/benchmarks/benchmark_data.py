"""The data pipeline at scale: tokenizing into a token store, opening it, and what training from it costs.

    .venv/bin/python scripts/benchmarks/benchmark_data.py --doc  # ~15 min on 2 cores; rewrites docs/benchmarks.md's
                                                                # "Data" section
    .venv/bin/python scripts/benchmarks/benchmark_data.py --build-mb 32 --big-mb 64   # a quick look

Corpora (made once under --work, deterministic): ``jsonl`` files of Shakespeare passages (the built-in corpus
split into paragraphs of ~2-4 KB, each copy numbered so no two documents are equal), ``--build-mb`` for the
tokenization throughput and ``--big-mb`` for the memory check.

Measured, each in its own process on a quiet machine:

* **tokenization**: ``open_or_build`` into an empty cache with 1 and with 2 processes (``num_proc``): documents,
  tokens and tokens/s, wall time including reading the files. With one process the Rust tokenizer's batch
  encoding already runs on every core (``TOKENIZERS_PARALLELISM``); with several, one thread each.
* **open**: opening the built store again (the median of 20), i.e. what every later run pays.
* **training**: the debug model, 2 processes, 20 steps (``--training.steps 20``, local batch 8 x seq 2048, as
  scripts/benchmarks/benchmark.py's memory workload), on the built-in corpus and on the big corpus: peak RSS per
  rank and the share of the step spent waiting for data (the trainer's own ``time_metrics/data_loading(%)``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import harness

DOC = harness.DOCS / "benchmarks.md"
BEGIN, END = "<!-- benchmark_data: begin -->", "<!-- benchmark_data: end -->"
TOKENIZER = harness.REPO / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"


def make_corpus(folder: Path, megabytes: int, first_copy: int = 0) -> list[Path]:
    """``megabytes`` of jsonl in 64 MB files (one document per line), the documents numbered from ``first_copy``
    (corpora with other numbers share no document); reused if already there."""
    from titan_simple.data.datasets import shakespeare_files

    done = folder / "corpus.done"  # not a .json: the folder is read as the dataset
    if done.is_file() and json.loads(done.read_text()) == {"megabytes": megabytes, "first_copy": first_copy}:
        return sorted(folder.glob("*.jsonl"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.jsonl"):
        old.unlink()
    passages = []
    for path in shakespeare_files("train"):
        paragraphs, current = [], ""
        for block in path.read_text().split("\n\n"):
            current += block + "\n\n"
            if len(current) > 2000:
                paragraphs.append(current)
                current = ""
        passages.extend(paragraphs)
    target, written, copy, part = megabytes << 20, 0, first_copy, 0
    out = None
    while written < target:
        for passage in passages:
            if out is None or out.tell() >= 64 << 20:
                if out is not None:
                    out.close()
                out = (folder / f"part-{part:04d}.jsonl").open("w")
                part += 1
            line = json.dumps({"text": f"[{copy}] {passage}"}) + "\n"
            out.write(line)
            written += len(line)
            copy += 1
            if written >= target:
                break
    out.close()
    done.write_text(json.dumps({"megabytes": megabytes, "first_copy": first_copy}))
    return sorted(folder.glob("*.jsonl"))


def build_once(files: list[str], cache: str, num_proc: int) -> dict:
    """Worker: build a store from scratch and report (run in a fresh process)."""
    import logging

    from titan_simple.data.token_store import StoreSource, TokenStore, open_or_build
    from titan_simple.data.tokenizer import Tokenizer

    logging.basicConfig(level=logging.WARNING)
    tokenizer = Tokenizer(str(TOKENIZER))
    source = StoreSource("json", tuple(Path(f) for f in files), tokenizer.path, "the benchmark corpus")
    started = time.perf_counter()
    store = open_or_build(source, tokenizer, Path(cache), builds=True, num_proc=num_proc)
    seconds = time.perf_counter() - started
    opens = []
    for _ in range(20):
        t = time.perf_counter()
        TokenStore(store.folder)
        opens.append(time.perf_counter() - t)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"documents": store.num_documents, "tokens": store.num_tokens, "seconds": seconds,
            "bytes": sum(Path(f).stat().st_size for f in files), "num_proc": num_proc,
            "open_ms": sorted(opens)[len(opens) // 2] * 1e3, "folder": str(store.folder),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_peak_rss_mib": children / 2**20}


def run_build(files: list[Path], cache: Path, num_proc: int) -> dict:
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    job = harness.launch(Path(__file__).resolve(), "--worker-build", json.dumps([str(f) for f in files]), cache,
                         str(num_proc))
    return job.check(f"building the store with {num_proc} process(es)").last_json()


def run_training(name: str, dump: Path, cache: Path, *extra: str) -> dict:
    import shutil

    shutil.rmtree(dump, ignore_errors=True)
    harness.launch(harness.TRAIN, "--config", "llama3_debug.toml", "--training.steps", "20",
                   "--training.local_batch_size", "8", "--training.seq_len", "2048", "--metrics.log_freq", "1",
                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump, "--training.data_cache", cache,
                   *extra, nproc=2).check(f"training on {name}")
    records = harness.read_metrics(dump)
    measured = [r for r in records if r["step"] > 2]
    return {"name": name, "peak_rss_gib": max(r["memory/peak_rss(GiB)"] for r in records),
            "data_percent": sum(r["time_metrics/data_loading(%)"] for r in measured) / len(measured)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/titan_simple_benchmark_data")
    parser.add_argument("--build-mb", type=int, default=256)
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--reuse-builds", action="store_true",
                        help="take the build figures of the last run in --work (measure the training part only)")
    parser.add_argument("--worker-build", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_build:
        files, cache, num_proc = args.worker_build
        print(json.dumps(build_once(json.loads(files), cache, int(num_proc))))
        return
    load = os.getloadavg()[0]
    work = Path(args.work)
    print(f"load average before: {load:.2f}")
    saved = work / "builds.json"
    if args.reuse_builds and saved.is_file():  # the builds of the last run (the training part changed)
        builds, big = json.loads(saved.read_text())
    else:
        build_corpus = make_corpus(work / f"corpus_{args.build_mb}mb", args.build_mb)
        builds = [run_build(build_corpus, work / f"cache_build_{n}", n) for n in (1, 2)]
        big_corpus = make_corpus(work / f"corpus_{args.big_mb}mb", args.big_mb)
        big = run_build(big_corpus, work / "cache_big", 2)
        saved.write_text(json.dumps([builds, big]))
    for b in builds:
        print(f"build {b['num_proc']} process(es): {b['bytes'] / 2**20:.0f} MiB, {b['documents']:,} documents, "
              f"{b['tokens']:,} tokens in {b['seconds']:.1f} s = {b['tokens'] / b['seconds']:,.0f} tokens/s; "
              f"open {b['open_ms']:.2f} ms")
    print(f"big: {big['bytes'] / 2**20:.0f} MiB, {big['tokens']:,} tokens in {big['seconds']:.1f} s; "
          f"open {big['open_ms']:.2f} ms")
    # The built-in corpus's store is built first, so that neither run's peak RSS includes a build.
    harness.launch(harness.REPO / "scripts" / "prepare_data.py", "--config", "llama3_debug.toml",
                   "--training.data_cache", work / "cache_builtin").check("scripts/prepare_data.py")
    trainings = [
        run_training("built-in shakespeare (5.4 MB)", work / "dump_builtin", work / "cache_builtin"),
        run_training(f"{big['bytes'] / 2**30:.2f} GiB jsonl", work / "dump_big", work / "cache_big",
                     "--training.dataset", "json", "--training.dataset_path", str(work / f"corpus_{args.big_mb}mb")),
    ]
    for t in trainings:
        print(f"train on {t['name']}: peak RSS/rank {t['peak_rss_gib']:.3f} GiB, data {t['data_percent']:.2f}% of "
              "the step")
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}")
    if args.doc:
        harness.write_block(DOC, BEGIN, END, doc_block(builds, big, trainings, load, args))


def doc_block(builds: list[dict], big: dict, trainings: list[dict], load: float, args: argparse.Namespace) -> str:
    """The doc's "Data" block (between its markers, set off by blank lines)."""
    lines = ["",
             f"`python scripts/benchmarks/benchmark_data.py --doc --build-mb {args.build_mb} --big-mb {args.big_mb}` "
             f"({time.strftime('%Y-%m-%d')}, 2 cores, load average {load:.2f} at the start).", "",
             "| token store build | text | documents | tokens | wall s | tokens/s | open (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for b in [*builds, big]:
        lines.append(f"| {b['num_proc']} process(es) | {b['bytes'] / 2**20:,.0f} MiB | {b['documents']:,} | "
                     f"{b['tokens']:,} | {b['seconds']:.1f} | {b['tokens'] / b['seconds']:,.0f} | "
                     f"{b['open_ms']:.2f} |")
    lines += ["", "| debug model, 2 processes, local batch 8 x 2048, 20 steps | peak RSS per rank | data time "
              "(% of the step) |", "|---|---:|---:|"]
    for t in trainings:
        lines.append(f"| {t['name']} | {t['peak_rss_gib'] * 1024:,.0f} MiB | {t['data_percent']:.2f}% |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()
