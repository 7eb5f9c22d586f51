"""Average the model weights of several checkpoints of one run into a new folder, in one process.

    .venv/bin/python scripts/average_checkpoints.py --checkpoint_folder outputs/llama3_debug/checkpoint --last 3
    .venv/bin/python scripts/average_checkpoints.py outputs/run/checkpoint/step-80 outputs/run/checkpoint/step-100 \\
        --output outputs/run/averaged

``--last K`` takes the newest K complete step folders of ``--checkpoint_folder``; or name the step folders. The
output (default ``<checkpoint folder>/step-<newest>-average<K>``) is a model-only step folder: load it with
``--checkpoint.initial_load_path``, ``scripts/generate.py`` or export it with ``scripts/export_hf.py``. The inputs
may come from any layout. One copy of the model in memory, whatever K (``trainer/checkpoint_average.py``); the
last line reports the process's peak RSS and the averaging's own memory at its largest (anonymous memory sampled
after each weight and after the save) against the size of one copy.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent

from titan_simple.errors import ConfigError, UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from titan_simple.trainer.checkpoint_average import average_checkpoints, check_inputs
    from titan_simple.trainer.checkpoint_files import complete_steps, read_marker, step_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", help="step folders of one run")
    parser.add_argument("--checkpoint_folder", help="a run's checkpoint folder, with --last")
    parser.add_argument("--last", type=int, help="average the newest this many complete steps of --checkpoint_folder")
    parser.add_argument("--output", help="the new folder (default: <checkpoint folder>/step-<newest>-average<K>)")
    args = parser.parse_args(argv)
    try:
        folders = [Path(f) for f in args.folders]
        if args.last is not None or args.checkpoint_folder is not None:
            if folders or args.last is None or args.checkpoint_folder is None:
                raise ConfigError("give --checkpoint_folder with --last, or step folders, not both.")
            steps = complete_steps(args.checkpoint_folder)
            if len(steps) < args.last:
                raise ConfigError(f"{args.checkpoint_folder} holds {len(steps)} complete step(s), fewer than --last "
                                  f"{args.last}.")
            folders = [step_folder(args.checkpoint_folder, step) for step in steps[-args.last:]]
        paths, weights = check_inputs(folders)
        newest = max(paths, key=lambda p: read_marker(p).get("step", -1))
        output = Path(args.output) if args.output else paths[0].parent / f"{newest.name}-average{len(paths)}"
        start = _anonymous_mib()
        samples = [start]
        average_checkpoints(paths, output, probe=lambda: samples.append(_anonymous_mib()))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    one_copy = sum(shape.numel() for shape in weights.values()) * 4 / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"averaged {len(paths)} checkpoints into {output}; peak RSS {peak:.1f} MiB; the averaging's own memory "
          f"{max(samples) - start:.1f} MiB at its largest, one fp32 copy of the model {one_copy:.1f} MiB")
    return 0


def _anonymous_mib() -> float:
    """This process's anonymous resident memory now (RssAnon: what it allocated, not the pages of the libraries
    it maps, which the page cache's state inflates), in MiB; Linux."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    sys.exit(main())
