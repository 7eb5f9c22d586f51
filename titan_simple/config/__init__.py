"""Job configuration: the schema (``schema.py``: typed sections, each field documented where declared) and its
loading (``loading.py``: TOML, command-line overrides, validation, ``--help``)."""

from titan_simple.config.loading import help_text, load_job_config, resolve_project_path, validate
from titan_simple.config.schema import (
    ActivationCheckpoint,
    DryRun,
    Float8,
    JobConfig,
    Parallelism,
    Profiling,
)

__all__ = ["ActivationCheckpoint", "DryRun", "Float8", "JobConfig", "Parallelism", "Profiling", "help_text",
           "load_job_config", "resolve_project_path", "validate"]
