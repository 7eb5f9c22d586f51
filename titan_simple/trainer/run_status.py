"""``<dump_folder>/run_status.json``: how the last run ended, for scripts that decide what to do next.

torchrun (torch 2.13) exits 1 whenever it receives SIGINT or SIGTERM, whatever its workers did: its signal
handler raises ``SignalException`` and nothing catches it. So the exit status cannot tell a clean stop on
request from a crash; this file can. Rank 0 writes it (atomically: a temporary file, then a rename):

    {"state": "running",  "step": 7, "steps": 50, "time": ...}                 when the loop starts
    {"state": "stopped",  "step": 11, "steps": 50, "signal": "SIGTERM",
     "checkpoint": ".../checkpoint/step-11", "time": ...}                      stopped on request, checkpoint saved
    {"state": "finished", "step": 50, "steps": 50, "checkpoint": ..., ...}     every step done
    {"state": "failed",   "step": 3, "steps": 50, "error": "...", ...}        an exception ended the loop

``stopped`` is written only after every rank agreed to stop and the checkpoint is complete (or checkpointing
is off: then ``checkpoint`` is null). A run killed outright (SIGKILL, a segfault, a lost node) leaves
``running``. ``scripts/run_status.py`` reads it for ``scripts/multinode.slurm``: requeue after ``stopped`` with
a checkpoint, not after anything else.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "run_status.json"
STATES = ("running", "stopped", "finished", "failed")


def status_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / FILE_NAME


class RunStatus:
    """Writes the status file on rank 0; a no-op elsewhere."""

    def __init__(self, dump_folder: str, *, rank: int, steps: int) -> None:
        self.path = status_path(dump_folder)
        self.enabled = rank == 0
        self.steps = steps

    def write(self, state: str, step: int, **fields: Any) -> None:
        if not self.enabled:
            return
        assert state in STATES, state
        record = {"state": state, "step": step, "steps": self.steps, **fields, "time": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, self.path)  # a reader never sees half a file

    def write_failure(self, step: int, error: BaseException) -> None:
        """Best effort, while an exception propagates: never hides it."""
        try:
            self.write("failed", step, error=f"{type(error).__name__}: {error}"[:500])
        except OSError as write_error:
            logger.error("could not write %s: %s", self.path, write_error)


def read_run_status(dump_folder: str | os.PathLike) -> dict[str, Any] | None:
    """The last status written to ``dump_folder``, or None when there is none (or it cannot be parsed)."""
    try:
        record = json.loads(status_path(dump_folder).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("state") in STATES else None
