"""How did the last run end? Reads ``<dump_folder>/run_status.json`` (``titan_simple/trainer/run_status.py``).

    .venv/bin/python scripts/run_status.py [--since EPOCH_SECONDS] --config CONFIG.toml [--section.key value ...]

Takes the same config and overrides as ``train.py`` (they name the dump folder; with ``[fault_tolerance] enable``
the replica group's folder in it, ``<dump_folder>/replica_<id>``), prints one line and exits:

    0   finished: every step done
    75  stopped on request (SIGINT / SIGTERM) after saving a checkpoint: run the same command again to resume
        (75 is EX_TEMPFAIL, "try again"; scripts/multinode.slurm requeues the job)
    1   anything else: failed, killed while running (the file still says "running"), stopped with no checkpoint
        to resume from, or no status written since --since (the run died before training; the file is stale)
    2   a config error

torchrun's own exit status cannot tell these apart: torch 2.13's torchrun exits 1 after any SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import time

from titan_simple.config import load_job_config  # noqa: E402
from titan_simple.errors import UserError  # noqa: E402
from titan_simple.trainer.fault_tolerance import log_folder  # noqa: E402
from titan_simple.trainer.run_status import read_run_status, status_path  # noqa: E402

FINISHED, RESUMABLE, NOT_RESUMABLE, CONFIG_ERROR = 0, 75, 1, 2


def verdict(record: dict | None, since: float | None) -> tuple[int, str]:
    """The exit code and the line to print for a status record."""
    if record is None:
        return NOT_RESUMABLE, "no run status: the run did not reach training"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", 0)))
    where = f"step {record.get('step')} of {record.get('steps')}, {when}"
    if since is not None and record.get("time", 0) < since:
        return NOT_RESUMABLE, f"stale: the last status ({record['state']}, {where}) is older than this run"
    state = record["state"]
    if state == "finished":
        return FINISHED, f"finished: {where}"
    if state == "stopped" and record.get("checkpoint"):
        return RESUMABLE, f"stopped by {record.get('signal')} at {where}; resume from {record['checkpoint']}"
    if state == "stopped":
        return NOT_RESUMABLE, f"stopped by {record.get('signal')} at {where} with no checkpoint ([checkpoint] enable)"
    if state == "failed":
        return NOT_RESUMABLE, f"failed at {where}: {record.get('error')}"
    return NOT_RESUMABLE, f"killed while running (last status: running from {where})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--since", type=float, default=None,
                        help="seconds since the epoch when the run was launched: older statuses are stale")
    args, rest = parser.parse_known_args(argv)
    try:
        config = load_job_config(rest)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return CONFIG_ERROR
    folder = log_folder(config)
    code, line = verdict(read_run_status(folder), args.since)
    print(f"{status_path(folder)}: {line}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
