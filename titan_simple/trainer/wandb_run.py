"""Weights & Biases beside TensorBoard: what :class:`~titan_simple.trainer.metrics.MetricsLogger` writes, mirrored
into one W&B run per dump folder (``[metrics] enable_wandb``).

``wandb`` is imported only when a run enables it (importing it takes about 1.7 s). The run starts at the first
logged step, like the other sinks, so a job that fails before it leaves no W&B run behind. Its id is kept in
``<dump_folder>/wandb_run_id``: a run resumed from a checkpoint (its first logged step is after step 1) continues
that W&B run, a run from step 1 starts a new one. ``WANDB_RUN_ID`` wins over both.

Names: a ``[metrics] wandb_*`` key that is set wins over its ``WANDB_*`` environment variable, as an argument of
``wandb.init`` does; an empty key leaves it to the variable, then to wandb's default (the project:
``titan_simple``). Files go to ``<dump_folder>/wandb`` unless ``WANDB_DIR`` is set; with ``WANDB_MODE=offline``
nothing leaves the machine (``wandb sync <folder>`` uploads it later).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "titan_simple"
INSTALL_HINT = "pip install -e '.[wandb]' or --metrics.enable_wandb=false"


@dataclass(frozen=True)
class WandbOptions:
    """``[metrics]``'s W&B keys ('' = the environment variable's or wandb's default) and the job config."""

    project: str = ""
    entity: str = ""
    run_name: str = ""
    group: str = ""  # fault tolerance: the job's replica groups log one W&B run each, grouped under this name
    config: dict[str, Any] = field(default_factory=dict)  # the W&B run's config: the whole job config


def wandb_options(config: JobConfig) -> WandbOptions:
    """The W&B settings of a job; under fault tolerance each replica group is a run of its own (each group's rank
    0 logs what its group sees), named after its replica id and grouped under the job's name."""
    metrics, ft = config.metrics, config.fault_tolerance
    if not ft.enable:
        return WandbOptions(project=metrics.wandb_project, entity=metrics.wandb_entity,
                            run_name=metrics.wandb_run_name, config=config.to_dict())
    job = metrics.wandb_run_name or Path(config.job.dump_folder).name
    return WandbOptions(project=metrics.wandb_project, entity=metrics.wandb_entity,
                        run_name=f"{job} replica {ft.replica_id}", group=job, config=config.to_dict())


def check_installed() -> None:
    """One line, before anything is built, when the package is missing (without importing it)."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"[metrics] enable_wandb = true needs the wandb package: {INSTALL_HINT}.")


class WandbRun:
    """One W&B run: :meth:`open` at the first logged step, :meth:`log` every logged step, :meth:`close` at the end.

    W&B refuses a step lower than the run's current one (it drops the values with a warning per call). A run resumed
    from a checkpoint older than the last logged step logs those steps again; they stay in ``metrics.jsonl`` and
    TensorBoard, are left out of the W&B run (which holds them from before), and one warning says so.
    """

    def __init__(self, dump_folder: str, options: WandbOptions) -> None:
        import wandb  # here only: importing wandb 0.29 takes ~1.7 s, paid only by the runs that enable W&B

        self._wandb = wandb
        self.dump_folder = dump_folder
        self.options = options
        self.id_path = Path(dump_folder) / RUN_ID_FILE
        self.run: Any = None
        self._accepts_from = 0  # the lowest step W&B takes
        self._warned = False
        # wandb's chatter (banner, run summary) off unless the user asked for it; one line of ours says where the
        # run is. Its service process starts now, not inside a timed log window; it writes no file.
        self._settings = wandb.Settings(silent=True) if "WANDB_SILENT" not in os.environ else wandb.Settings()
        wandb.setup(self._settings)

    def _run_id(self, continuing: bool) -> str | None:
        """``WANDB_RUN_ID``; else, continuing a resumed run, the id kept in the dump folder; else None (wandb makes
        a new one)."""
        if os.environ.get("WANDB_RUN_ID"):
            return os.environ["WANDB_RUN_ID"]
        if continuing and self.id_path.is_file():
            return self.id_path.read_text().strip() or None
        return None

    def open(self, first_step: int) -> None:
        """Start (or, after a resume, continue) the run; ``first_step`` is the step about to be logged."""
        options = self.options
        try:
            self.run = self._wandb.init(
                id=self._run_id(continuing=first_step > 1), resume="allow",
                project=options.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                entity=options.entity or None, name=options.run_name or None, group=options.group or None,
                dir=None if os.environ.get("WANDB_DIR") else self.dump_folder, settings=self._settings,
            )
        except self._wandb.errors.Error as error:  # no login, no network, a bad entity: one line, not a traceback
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"[metrics] enable_wandb: W&B could not start the run ({reason}); run `wandb login`, "
                              "set WANDB_MODE=offline, or pass --metrics.enable_wandb=false.") from None
        # After init, not as its config= argument: a resumed run may change keys (more steps, say).
        self.run.config.update(options.config, allow_val_change=True)
        self._accepts_from = int(self.run.step)
        if self.run.disabled:
            logger.info("W&B: disabled (WANDB_MODE=disabled)")
            return
        self.id_path.write_text(self.run.id + "\n")
        logger.info(self.where())

    def where(self) -> str:
        if self.run.offline:
            folder = self.run.settings.sync_dir
            return f"W&B: offline run {self.run.id} in {folder} (upload: wandb sync {folder})"
        return f"W&B: run {self.run.name} ({self.run.id}) at {self.run.url}"

    def log(self, step: int, values: dict[str, float]) -> None:
        if step < self._accepts_from:
            if not self._warned:
                logger.warning("W&B run %s already holds steps up to %d (this run resumed from an earlier checkpoint):"
                               " steps before %d go to metrics.jsonl and TensorBoard only", self.run.id,
                               self._accepts_from - 1, self._accepts_from)
                self._warned = True
            return
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        """Finish the run, marked failed when an exception is ending the job."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
