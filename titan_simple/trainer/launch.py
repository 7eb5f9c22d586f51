"""``titan-run``: ``torchrun`` for ``train.py``, with the config checked before any rank starts and the trainer's
own errors kept to their one line.

    .venv/bin/titan-run --nproc_per_node=8 train.py --config configs/llama3_8b.toml [--section.key value ...]

It takes torchrun's arguments unchanged. Before it starts a process it loads the training script's config and runs
the checks each rank runs first (``trainer.plan_and_check``) for the job's world size (nnodes x nproc_per_node, when
nnodes is one number): a bad key, type, path or degree is the trainer's one ``error:`` line and exit status 2, and
no rank starts. Then it runs torchrun. A rank that stops with one of the trainer's own errors has printed its line
(exit status 2: input a rank found unusable, a checkpoint it cannot read or write; 3: the loss became non-finite):
``titan-run`` exits with that status, without torchrun's ``ChildFailedError`` report. A SIGINT / SIGTERM to the
launcher stops the ranks as torchrun does, then one line and status 128 + the signal's number. Any other failure (a
crash) keeps torchrun's report. Plain ``torchrun train.py`` runs the same job; on those errors it prints its
traceback and exits 1.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from titan_simple.errors import UserError

TRAINER_EXIT_CODES = (2, 3)  # train.py's exit statuses for the errors it prints as one line
# What of torchrun (torch.distributed.run, torch 2.13) this module uses beyond its command line: its argument parser,
# run(), the helpers that read --nnodes / --nproc_per_node, and its agent's log line for a failed rank; the test
# tests/test_config.py::test_the_parts_of_torchrun_titan_run_uses_exist fails if torch changes them.
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
FAILED_RANK_LINE = "failed (exitcode: {code})"


def _world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """The job's world size when torchrun's arguments fix it, else None (an elastic range of nodes)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    low, high = parse_min_max_nnodes(nnodes)
    return low * determine_local_world_size(nproc_per_node) if low == high else None


def check_job(script: str, script_args: list[str], world_size: int | None) -> None:
    """The checks each rank of a ``train.py`` job runs first, once, here (a UserError's one line); nothing for
    another script, a dry run or a precompile (train.py runs those in one process: they start no ranks)."""
    if Path(script).name != "train.py" or any(arg in ("-h", "--help") for arg in script_args):
        return
    from titan_simple.compile.cache_folder import check_cache_variable
    from titan_simple.config import load_job_config

    config = load_job_config(script_args)
    check_cache_variable()  # before the trainer's modules: importing torch's compiler makes the folder
    if config.dry_run.enable or config.compile.precompile_world_size or world_size is None:
        return
    import torch

    from titan_simple.trainer.trainer import plan_and_check

    plan_and_check(config, world_size, "cuda" if torch.cuda.is_available() else "cpu")


class _DropTrainerExitReports(logging.Filter):
    """torchrun's agent logs ``failed (exitcode: N)`` when a rank exits; for the trainer's own statuses the rank
    has already said why, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(FAILED_RANK_LINE.format(code=code) in record.getMessage() for code in TRAINER_EXIT_CODES)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # the plan's checks log nothing worth reading
    try:
        if not (args.module or args.no_python):
            check_job(args.training_script, args.training_script_args, _world_size(args.nnodes, args.nproc_per_node))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.getLogger(AGENT_LOGGER).addFilter(_DropTrainerExitReports())
    try:
        run(args)
    except ChildFailedError as failed:
        _, first = failed.get_first_failure()
        if first.exitcode in TRAINER_EXIT_CODES:  # the rank printed its one line
            return first.exitcode
        raise
    except SignalException as stopped:  # SIGINT / SIGTERM to the launcher: torchrun has stopped the ranks
        print(f"titan-run: stopped by {stopped.sigval.name}; the ranks were stopped too (their lines are above)",
              file=sys.stderr)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
