"""Check the dry run against measurement on this CPU: predicted vs measured peak tensor memory and step time.

    python scripts/benchmarks/dry_run_cpu_check.py                       # debug model, lbs 4 x 128, 2 and 4 processes
    python scripts/benchmarks/dry_run_cpu_check.py --world_sizes 2 --steps 3 --config llama3_debug.toml \
        --training.seq_len 128

For each world size N: N gloo processes measure the machine's rates while all N run (matmul FLOP/s, copy
bandwidth, all-gather bandwidth and latency; per-op overhead = an 8-token step of the same model, whose compute
is negligible, less its collectives' latency, divided by the ops the dry run prices in it), time ``--steps``
training steps of the model built exactly as the trainer builds it (fp32, eager, one local batch of random
tokens), and trace one more step with the dry run's ``StepTracer`` on real tensors (peak live tensor-storage
bytes; the collectives). Then a fresh process runs the dry run for the same config with ``device = cpu`` and the
measured rates plugged in. Prints a markdown table (and the JSON with ``--json FILE``). Any
``--section.key value`` is passed to both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import harness


def predict(argv: list[str], world_size: int, rates: dict[str, float]) -> dict:
    """The dry run in its own process (one per process: see ``run_dry_run``), the measured rates plugged in."""
    with tempfile.TemporaryDirectory() as folder:
        code = (
            "import json, sys\n"
            "from titan_simple.config import load_job_config\n"
            "from titan_simple.dry_run.run import run_dry_run\n"
            "from titan_simple.dry_run.hardware import device_spec\n"
            "rates = json.loads(sys.argv[1])\n"
            "config = load_job_config(sys.argv[2:])\n"
            "spec = device_spec('cpu', config.dry_run.world_size, peak_flops=rates['matmul_flops'],\n"
            "    memory_bandwidth=rates['memory_bandwidth'], intra_node_bandwidth=rates['allgather_bandwidth'],\n"
            "    inter_node_bandwidth=rates['allgather_bandwidth'], collective_latency=rates['allgather_latency'],\n"
            "    kernel_overhead=rates['op_overhead'])\n"
            "run_dry_run(config, spec=spec)\n"
        )
        args = [*argv, "--dry_run", "--dry_run.device", "cpu", "--dry_run.world_size", str(world_size),
                "--job.dump_folder", folder]
        job = harness.launch("-c", code, json.dumps(rates), *args, env=os.environ)
        job.check(f"the dry run for {world_size} processes")
        with open(os.path.join(folder, "dry_run.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args, rest = parser.parse_known_args()
    # Pinned (not the config's current batch), so the doc's numbers stay reproducible.
    argv = ["--config", "llama3_debug.toml", "--training.local_batch_size", "4", "--training.seq_len", "128", *rest]

    from titan_simple.dry_run.cpu_measurement import measure

    rows = []
    for n in args.world_sizes:
        measured = measure(n, argv, steps=args.steps)
        predicted = predict(argv, n, measured["rates"])
        rows.append({"world_size": n, "measured": measured, "predicted": predicted})
        mem_p, mem_m = predicted["memory_bytes"]["peak"], measured["peak_bytes"]
        t_p, t_m = predicted["time_seconds"]["step"], measured["step_seconds"]
        print(f"N={n}: peak memory predicted {mem_p / 1e6:.1f} MB, measured {mem_m / 1e6:.1f} MB "
              f"({100 * (mem_p / mem_m - 1):+.0f}%); step predicted {t_p * 1e3:.0f} ms, "
              f"measured {t_m * 1e3:.0f} ms "
              f"({100 * (t_p / t_m - 1):+.0f}%)", flush=True)
    print("\n| processes | matmul GFLOP/s | all-gather GB/s | peak MB predicted | measured | error | "
          "step ms predicted | measured | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        mem_p, mem_m = p["memory_bytes"]["peak"], m["peak_bytes"]
        t_p, t_m = p["time_seconds"]["step"], m["step_seconds"]
        print(f"| {r['world_size']} | {m['rates']['matmul_flops'] / 1e9:.1f} | "
              f"{m['rates']['allgather_bandwidth'] / 1e9:.2f} | {mem_p / 1e6:.1f} | {mem_m / 1e6:.1f} | "
              f"{100 * (mem_p / mem_m - 1):+.0f}% | {t_p * 1e3:.0f} | {t_m * 1e3:.0f} | "
              f"{100 * (t_p / t_m - 1):+.0f}% |")
    if args.json:
        harness.save_json(args.json, rows)


if __name__ == "__main__":
    main()
