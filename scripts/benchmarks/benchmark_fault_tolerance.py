"""What fault tolerance costs and what a failure costs, measured side by side on the same 4 processes.

    python scripts/benchmarks/benchmark_fault_tolerance.py [--steps 60] [--out docs/fault_tolerance.md]

Runs, one after another on a quiet machine (check ``uptime`` first), the debug model for ``--steps`` steps with
the metrics of every step:

1. HSDP 2 x 2 (``data_parallel_replicate_degree 2``) on one torchrun of 4 processes: the plain way to replicate;
2. fully_shard on 4 processes (the same global batch);
3. fault tolerance, 2 replica groups x 2 processes (scripts/fault_tolerance.py), no failure;
4. the same with group 1 SIGKILLed between steps after step 10 and restarted, then SIGKILLed inside its
   cross-group all-reduce at step 30 (or its first step after rejoining) and restarted again.

and writes a table into ``--out`` (between its ``benchmark`` markers) and the raw numbers to
``outputs/benchmark_fault_tolerance/results.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import harness

BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"
STEP_S = "time_metrics/end_to_end(s)"
LIVE = "fault_tolerance/live_groups"


def common_args(steps: int) -> list[str]:
    return ["--config", "llama3_debug.toml", "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false"]


def run_plain(dump: Path, steps: int, *extra: str) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)  # metrics.jsonl is appended to: start from an empty folder
    harness.launch(harness.TRAIN, *common_args(steps), "--job.dump_folder", dump, *extra, nproc=4).check(
        f"the 4-process run in {dump.name}")
    return harness.read_metrics(dump)


def run_groups(dump: Path, steps: int, kills: list[str], *extra: str) -> tuple[list[dict], list[dict], list, list]:
    shutil.rmtree(dump, ignore_errors=True)
    # The lighthouse gives up on a silent group after 2 s (torchft's default: 5 s): a restart here takes ~7 s, so
    # with 5 s the survivors would often wait for the restarted group instead of going on alone.
    harness.launch(harness.REPO / "scripts" / "fault_tolerance.py", "--groups", "2", "--nproc", "2",
                   "--dump-folder", dump, "--restart", str(len(kills)), "--heartbeat-timeout-ms", "2000",
                   *[f"--kill={k}" for k in kills], "--", *common_args(steps), *extra).check(
        f"the replica groups in {dump.name}")
    return read_failure_run(dump)


def read_failure_run(dump: Path) -> tuple[list[dict], list[dict], list, dict]:
    return (harness.read_metrics(dump / "replica_0"), harness.read_metrics(dump / "replica_1"),
            json.loads((dump / "launcher_events.json").read_text()),
            json.loads((dump / "launcher_steps.json").read_text()))


def steady(metrics: list[dict], key: str = STEP_S, skip: int = 5) -> float:
    """The median of ``key`` over the steps after the first ``skip`` (start-up, warm caches)."""
    return statistics.median(m[key] for m in metrics[skip:])


def failure_numbers(survivor: list[dict], rejoined: list[dict], events: list[dict], step_times: dict,
                    typical_step: float) -> dict:
    """Per failure of group 1, which had committed step c: the survivor's stall (how much longer than a typical
    step its step c + 1 took to appear after step c: waiting for the lighthouse to give up on the dead group and,
    killed mid-all-reduce, the failed attempt), and how long the restarted group took from the kill to its first
    step (start-up, quorum, the transfer of the live state, one step)."""
    kills = [e for e in events if e["event"] == "killed"]
    first_steps = [e for e in events if e["event"] == "first_step" and e["group"] == 1 and e["attempt"] > 0]
    out = {"survivor_steps": [m["step"] for m in survivor] == list(range(1, len(survivor) + 1)),
           "survivor_uncommitted": survivor[-1]["fault_tolerance/uncommitted_steps"], "failures": []}
    by_step = {m["step"]: m for m in survivor}
    survivor_at = {step: t for t, step in step_times["0"]}
    for kill, first in zip(kills, first_steps, strict=True):
        committed = max(step for t, step in step_times["1"] if t <= kill["t"])
        healed = next(m for m in rejoined if m["step"] == first["step"])
        out["failures"].append({
            "at": kill["at"],
            "committed": committed,
            "survivor_stall_s": round(survivor_at[committed + 1] - survivor_at[committed] - typical_step, 1),
            "live_groups_then": by_step[committed + 1][LIVE],
            "restart_to_first_step_s": round(first["t"] - kill["t"], 1),
            "heal_quorum_s": round(healed["fault_tolerance/quorum_seconds"], 2),
            "rejoined_at_step": first["step"],
        })
    return out


def table(results: dict) -> str:
    hsdp, fsdp, ft = results["hsdp"], results["fully_shard"], results["groups"]
    lines = [
        f"Debug model, {results['steps']} steps, 4 processes on this 2-core CPU (gloo), one run after another; "
        "median step time over steps 6+.",
        "",
        "| run | step time (s) | tokens/s per process | vs HSDP 2 x 2 |",
        "|---|---|---|---|",
    ]
    for name, run in (("HSDP 2 x 2, one torchrun", hsdp), ("fully_shard 4, one torchrun", fsdp),
                      ("2 replica groups x fully_shard 2 (fault tolerance)", ft)):
        lines.append(f"| {name} | {run['step_s']:.3f} | {run['tps']:.0f} | {run['step_s'] / hsdp['step_s']:.2f}x |")
    lines += ["", f"Fault tolerance per step: quorum {ft['quorum_s'] * 1000:.0f} ms (a lighthouse round trip before "
              f"the forward), cross-group all-reduce {ft['allreduce_s'] * 1000:.0f} ms (bucketed, after the group's "
              "reduce-scatter), plus the commit's round trip.", ""]
    failure = results["failures"]
    lines += ["| failure of group 1 | survivor's stall (s) | its next step, live groups | kill to rejoined step (s) "
              "| heal: quorum + transfer (s) | rejoined at step |", "|---|---|---|---|---|---|"]
    for f in failure["failures"]:
        lines.append(f"| {f['at']} (committed {f['committed']}) | {f['survivor_stall_s']:.1f} | "
                     f"{f['committed'] + 1}, {f['live_groups_then']:.0f} | {f['restart_to_first_step_s']:.1f} | "
                     f"{f['heal_quorum_s']:.2f} | {f['rejoined_at_step']} |")
    lines += ["", f"The survivor logged every step 1..{results['steps']} once: {failure['survivor_steps']}; steps it "
              f"did not commit (retried on the same rows): {failure['survivor_uncommitted']:.0f}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(harness.DOCS / "fault_tolerance.md"))
    parser.add_argument("--dump", default=str(harness.REPO / "outputs" / "benchmark_fault_tolerance"))
    parser.add_argument("--recompute", action="store_true",
                        help="no runs: recompute the failure numbers and the table from the last results and logs")
    args = parser.parse_args()
    dump = Path(args.dump)
    if args.recompute:
        results = json.loads((dump / "results.json").read_text())
        results["failures"] = failure_numbers(*read_failure_run(dump / "failures"), results["groups"]["step_s"])
        write(results, dump, Path(args.out))
        return
    results: dict = {"steps": args.steps}
    for name, extra in (("hsdp", ["--parallelism.data_parallel_replicate_degree", "2",
                                  "--parallelism.data_parallel_shard_degree", "2"]), ("fully_shard", [])):
        metrics = run_plain(dump / name, args.steps, *extra)
        results[name] = {"step_s": steady(metrics), "tps": steady(metrics, "throughput(tps)"),
                         "final_loss": metrics[-1]["loss_metrics/global_avg_loss"]}
        print(name, results[name], flush=True)
    group0, _, _, _ = run_groups(dump / "groups", args.steps, [])
    results["groups"] = {"step_s": steady(group0), "tps": steady(group0, "throughput(tps)"),
                         "quorum_s": steady(group0, "fault_tolerance/quorum_seconds"),
                         "allreduce_s": steady(group0, "fault_tolerance/allreduce_seconds"),
                         "final_loss": group0[-1]["loss_metrics/global_avg_loss"]}
    print("groups", results["groups"], flush=True)
    # 1 MB buckets: the all-reduce kill falls between two buckets (one bucket of 25 MB would have been sent whole).
    survivor, rejoined, events, times = run_groups(dump / "failures", args.steps, ["1:10:between", "1:30:allreduce"],
                                                   "--fault_tolerance.bucket_cap_mb", "1")
    results["failures"] = failure_numbers(survivor, rejoined, events, times, results["groups"]["step_s"])
    results["failure_events"] = events
    print("failures", results["failures"], flush=True)
    write(results, dump, Path(args.out))


def write(results: dict, dump: Path, out: Path) -> None:
    (dump / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    harness.write_block(out, BEGIN, END, table(results))
    print(table(results))


if __name__ == "__main__":
    main()
