"""The summary of one ``scripts/gpu_session.sh`` run: each job's exit status, last step and first error; the
compiled-vs-eager loss differences; tokens/s, TFLOP/s and MFU of the speed pair; the rowwise probe's gradient norms;
the long-context session's losses and tokens/s.

    python scripts/gpu_session_summary.py LOG_DIR
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"step +(\d+)/\d+ \| (.*)$")
NUMBER = re.compile(r"^([\w/()%]+) ([-+0-9.,e]+)")
ERROR = re.compile(r"(Error|error:|Traceback|FAIL|Segmentation|core dumped|Killed)")
WARMUP = 4  # steps left out of the speed medians (compilation, the first allocator growth)


def steps(text: str) -> dict[int, dict[str, float]]:
    """``step N/M | key value | ...`` lines -> {N: {key: value}} (numbers only, commas dropped)."""
    found: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = STEP.search(line)
        if not match:
            continue
        fields = {}
        for part in match.group(2).split(" | "):
            number = NUMBER.match(part.strip())
            if number:
                try:
                    fields[number.group(1)] = float(number.group(2).replace(",", "").rstrip("%"))
                except ValueError:
                    pass
        found[int(match.group(1))] = fields
    return found


def first_error(text: str) -> str:
    for line in text.splitlines():
        if ERROR.search(line) and "UserWarning" not in line and "FutureWarning" not in line:
            return line.strip()[:300]
    return ""


def main(folder: Path) -> None:
    gpu = folder / "gpu.txt"
    if gpu.exists():
        print(gpu.read_text().strip())
    logs = {p.stem: p.read_text(errors="replace") for p in sorted(folder.glob("*.log"))}
    parsed = {name: steps(text) for name, text in logs.items()}
    print(f"{'job':<16} {'exit':>4} {'steps':>5}  last step / first error")
    for name, text in logs.items():
        status = re.findall(r"^exit (\d+)$", text, re.MULTILINE)
        last = max(parsed[name]) if parsed[name] else 0
        tail = "  ".join(f"{k} {v:g}" for k, v in list(parsed[name].get(last, {}).items())[:8])
        error = first_error(text) if not status or status[-1] != "0" else ""
        print(f"{name:<16} {status[-1] if status else '?':>4} {last:>5}  {tail}")
        if error:
            print(f"{'':<16} {'':>4} {'':>5}  first error: {error}")
    if "gpu_check" in logs:
        table = [line for line in logs["gpu_check"].splitlines() if "|" in line or line.startswith("gpu_check")]
        print("\n".join(["", "gpu_check:", *table]))
    compiled, eager = parsed.get("70b", {}), parsed.get("70b_eager", {})
    common = sorted(set(compiled) & set(eager))
    if common:
        diffs = [abs(compiled[s]["loss"] - eager[s]["loss"]) / abs(eager[s]["loss"]) for s in common]
        print(f"\n70b compiled vs eager, {len(common)} steps: loss rel diff max {max(diffs):.2e} "
              f"(first 5 steps {max(diffs[:5]):.2e}); losses step 1 {eager[common[0]]['loss']:.4f} -> "
              f"{eager[common[-1]]['loss']:.4f} (eager), {compiled[common[-1]]['loss']:.4f} (compiled)")
    print()
    for name, curve in parsed.items():
        if name.startswith("curve_") and len(curve) >= 10:
            last = sorted(curve)[-10:]
            print(f"{name}: mean loss of the last {len(last)} logged steps ({last[0]}-{last[-1]}) "
                  f"{statistics.mean(curve[s]['loss'] for s in last):.4f}")
    probes = sorted(n for n in parsed if n.startswith("probe_"))
    if probes:  # the rowwise probe: gradient norms step by step, against bf16's
        print("gradient norms by step (rowwise probe):")
        for name in probes:
            norms = [f"{parsed[name][s].get('grad_norm', float('nan')):g}" for s in sorted(parsed[name])]
            print(f"  {name:<24} {' '.join(norms) or 'no step'}")
    long_context = sorted(n for n in parsed if n.startswith("lc_"))
    if long_context:  # SDPA against FlexAttention: the losses step by step, tokens/s after the warm-up
        print("losses by step, median tokens/s after the warm-up (long context):")
        for name in long_context:
            losses = " ".join(f"{parsed[name][s].get('loss', float('nan')):.4f}" for s in sorted(parsed[name]))
            tps = [v["tps"] for s, v in parsed[name].items() if s > WARMUP and "tps" in v]
            print(f"  {name:<24} {losses or 'no step'}" + (f"  tps {statistics.median(tps):,.0f}" if tps else ""))
    for name in sorted(n for n in parsed if n.startswith("speed_")):
        measured = [v for s, v in parsed.get(name, {}).items() if s > WARMUP]
        if not measured:
            print(f"{name}: no measured steps")
            continue
        keys = sorted({k for v in measured for k in v} - {"step", "lr", "eta"})
        medians = {k: statistics.median(v[k] for v in measured if k in v) for k in keys}
        print(f"{name}: median of {len(measured)} steps after {WARMUP}: "
              + " | ".join(f"{k} {v:g}" for k, v in medians.items()))
    for path in sorted(folder.rglob("*")):
        if path.is_file() and any(word in path.name for word in ("trace", "snapshot", "memory")):
            print(f"file {path.relative_to(folder)}: {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
