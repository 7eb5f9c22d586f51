"""Causal against block-causal attention, side by side, on a corpus of short documents.

    .venv/bin/python scripts/benchmarks/benchmark_attention.py            # ~10 minutes on 2 cores; a quiet machine
    .venv/bin/python scripts/benchmarks/benchmark_attention.py --doc      # also rewrites docs/benchmarks.md's table

**Training rows**: one ``torchrun --nproc_per_node=2 train.py`` job per row and repeat (repeats interleaved, so a
slow spell hits every row alike): the benchmark model (``debugmodel_large``) at seq 2048, SimpleFSDP over 2
processes, compiled, the machine's automatic precision, on a corpus of short documents made here from the built-in
Shakespeare texts (one document per paragraph). tokens/s per rank is the median over the steps after the warm-up
(compilation) of each job's ``metrics.jsonl``, then the median over repeats. FlexAttention rows are listed and not
run: torch 2.13's FlexAttention has no backward on CPU (the plan refuses ``attention = "flex"`` on CPU).

**Where the time goes**: the same process times SDPA's forward and backward at the model's attention shape
(``[1, 8, 2048, 64]`` queries, 4 KV heads), one thread as each rank has: with ``is_causal``, with the causal mask as
a boolean tensor, and with the block-causal mask of a corpus row. The kernel is the CPU flash kernel in all three.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

from titan_simple.data.datasets import shakespeare_files
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.models.attention import block_causal_mask, document_ids

DOC = harness.DOCS / "benchmarks.md"
MARKERS = ("<!-- attention table -->", "<!-- /attention table -->")
SEQ_LEN = 2048
ROWS = {
    "sdpa causal": ("--model.attention=sdpa", "--model.attention_mask=causal"),
    "sdpa block_causal": ("--model.attention=sdpa", "--model.attention_mask=block_causal"),
}
NOT_RUN = {"flex causal": "not run: FlexAttention has no backward on CPU in torch 2.13",
           "flex block_causal": "not run: FlexAttention has no backward on CPU in torch 2.13"}


def short_document_corpus(folder: Path) -> Path:
    """One JSON line per paragraph (blank-line separated) of the built-in Shakespeare texts."""
    path = folder / "paragraphs.jsonl"
    with path.open("w") as out:
        for text_file in shakespeare_files("train"):
            for paragraph in re.split(r"\n\s*\n", text_file.read_text(errors="replace")):
                paragraph = paragraph.strip()
                if len(paragraph) >= 20:
                    out.write(json.dumps({"text": paragraph}) + "\n")
    return path


def run_job(name: str, corpus: Path, folder: Path, steps: int, warmup: int) -> float:
    """Median tokens/s per rank over the steps after ``warmup`` of one 2-process compiled job."""
    dump = folder / f"{name.replace(' ', '_')}_{time.monotonic_ns()}"
    harness.launch(harness.TRAIN, "--config", "configs/llama3_debug.toml", "--model.flavor=debugmodel_large",
                   f"--training.seq_len={SEQ_LEN}", "--training.local_batch_size=1", "--training.global_batch_size=2",
                   f"--training.steps={steps + warmup}", f"--training.dataset_path={corpus}",
                   f"--training.data_cache={folder / 'data_cache'}", "--compile.enable", "--metrics.log_freq=1",
                   "--checkpoint.enable=false", "--validation.enable=false", "--metrics.enable_tensorboard=false",
                   f"--job.dump_folder={dump}", *ROWS[name], nproc=2).check(name)
    metrics = harness.read_metrics(dump)
    speeds = [m["throughput(tps)"] for m in metrics if m.get("step", 0) > warmup and "throughput(tps)" in m]
    return statistics.median(speeds)


def attention_seconds(corpus: Path, repeats: int = 5) -> dict[str, float]:
    """Forward + backward seconds of one SDPA call at the benchmark model's shape, median of ``repeats``."""
    torch.set_num_threads(1)
    tokenizer = Tokenizer(str(harness.REPO / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"))
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[1000:1200]]
    row = torch.tensor([t for ids in tokenizer.encode_batch(texts) for t in ids][:SEQ_LEN])[None]
    block = block_causal_mask(document_ids(row, tokenizer.eos_id))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, SEQ_LEN, 64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 4, SEQ_LEN, 64, generator=g, requires_grad=True) for _ in range(2))
    cases = {"is_causal": {"is_causal": True},
             "boolean causal mask": {"attn_mask": torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()},
             "block-causal mask": {"attn_mask": block}}
    seconds = {}
    for name, kwargs in cases.items():
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs).sum().backward()
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[1:])
    seconds["documents in the row"] = float(int(document_ids(row, tokenizer.eos_id).max()) + 1)
    return seconds


def table(speeds: dict[str, list[float]], attention: dict[str, float], load: float) -> str:
    base = statistics.median(speeds["sdpa causal"])
    lines = [f"Load average at the start: {load:.2f}.", "",
             "| attention | tokens/s per rank (median; repeats) | vs sdpa causal |", "|---|---|---|"]
    for name, values in speeds.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:,.0f} ({', '.join(f'{v:,.0f}' for v in values)}) | {median / base:.2f}x |")
    lines += [f"| {name} | {why} | |" for name, why in NOT_RUN.items()]
    lines += ["", f"SDPA forward + backward at [1, 8, {SEQ_LEN}, 64] (4 KV heads), one thread, median of 5; the "
              f"block-causal row holds {attention['documents in the row']:.0f} documents:", "",
              "| mask | seconds | vs is_causal |", "|---|---|---|"]
    for name in ("is_causal", "boolean causal mask", "block-causal mask"):
        lines.append(f"| {name} | {attention[name]:.3f} | {attention[name] / attention['is_causal']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (compilation)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--doc", action="store_true", help=f"rewrite the table in {DOC.relative_to(harness.REPO)}")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus = short_document_corpus(folder)
        speeds: dict[str, list[float]] = {name: [] for name in ROWS}
        for repeat in range(args.repeats):
            order = list(ROWS) if repeat % 2 == 0 else list(reversed(ROWS))
            for name in order:
                speeds[name].append(run_job(name, corpus, folder, args.steps, args.warmup))
                print(f"repeat {repeat + 1}: {name} {speeds[name][-1]:,.0f} tokens/s per rank", flush=True)
        attention = attention_seconds(corpus)
    text = table(speeds, attention, load)
    print(text)
    if args.doc:
        harness.write_block(DOC, *MARKERS, text)


if __name__ == "__main__":
    main()
