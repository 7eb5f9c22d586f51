"""The average of several checkpoints' model weights, written as a step folder of its own.

    average_checkpoints([".../step-80", ".../step-90", ".../step-100"], ".../step-100-average3")

The Llama 3 paper averages the checkpoints of its annealing phase into the released model. Each input is a
complete step folder of one run (any layout: DCP reshards on load); the output is a model-only DCP folder with a
``complete.json`` like any save's (the newest input's, plus ``averaged_from``), so ``--checkpoint.initial_load_path``,
``scripts/generate.py`` and ``scripts/export_hf.py`` read it as they read a step folder. Its name is not
``step-N``: the run's resume never mistakes it for its newest save.

Streaming: one fp32 running sum per weight, filled one group of weights and one input at a time (one ``dcp.load``
per group and input: DCP reads a checkpoint's metadata again on every call), so the process holds one copy of the
model plus one group (an eighth of the model, at most 256 MiB, or one weight), whatever the number of inputs. The
average is written in fp32, whatever the inputs' dtype (``export_hf.py --dtype`` casts an export).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_simple.errors import ConfigError
from titan_simple.trainer.checkpoint_files import MARKER, read_marker, read_metadata, resolve_checkpoint

logger = logging.getLogger("titan_simple")

GROUP_BYTES = 256 << 20
STEP_FOLDER = re.compile(r"^step-\d+$")


def _model_weights(path: Path) -> dict[str, torch.Size]:
    """The model's weights a step folder holds: DCP key (``model.<name>``) -> shape."""
    return {key: meta.size for key, meta in read_metadata(path).state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def check_inputs(folders: Sequence[str | Path]) -> tuple[list[Path], dict[str, torch.Size]]:
    """The step folders to average, checked before anything is read: at least two, complete, of one run (the
    same checkpoint folder) and one model (the model recorded in complete.json, the weights' names and shapes)."""
    if len(folders) < 2:
        raise ConfigError(f"averaging needs at least two step folders, got {len(folders)}.")
    paths = [resolve_checkpoint(folder).resolve() for folder in folders]
    if len(set(paths)) < len(paths):
        raise ConfigError("a step folder is named twice; name each checkpoint once.")
    first, first_marker, weights = paths[0], read_marker(paths[0]), _model_weights(paths[0])
    if not first_marker:
        raise ConfigError(f"{first} has no {MARKER}: not a complete step folder of a titan_simple run.")
    for path in paths[1:]:
        if path.parent != first.parent:
            raise ConfigError(f"{path} is of another run than {first} (another checkpoint folder); average the "
                              "saves of one run.")
        marker = read_marker(path)
        if marker.get("model_args") != first_marker.get("model_args"):
            raise ConfigError(f"{path} holds another model than {first} (its complete.json's model_args differ); "
                              "average the saves of one run.")
        if _model_weights(path) != weights:
            raise ConfigError(f"{path} holds other weights than {first} (names or shapes); average the saves of one "
                              "run.")
    return paths, weights


def _groups(weights: dict[str, torch.Size]) -> list[list[str]]:
    """The weights in load order, grouped so that each group's fp32 bytes stay under an eighth of the model's (and
    256 MiB), or are one weight: the buffer one load fills stays small beside the running sums."""
    sizes = {key: shape.numel() * 4 for key, shape in weights.items()}
    budget = min(GROUP_BYTES, sum(sizes.values()) // 8)
    groups: list[list[str]] = [[]]
    filled = 0
    for key, size in sizes.items():
        if groups[-1] and filled + size > budget:
            groups.append([])
            filled = 0
        groups[-1].append(key)
        filled += size
    return groups


def average_checkpoints(folders: Sequence[str | Path], output: str | Path,
                        probe: Callable[[], None] | None = None) -> Path:
    """Average the model weights of ``folders`` into the new folder ``output``; returns it. Refuses in one line
    (ConfigError) inputs of several runs or models, and an ``output`` that exists. ``probe`` is called after each
    weight's sum and after the save (the script samples its memory there)."""
    paths, weights = check_inputs(folders)
    output = Path(output)
    if output.exists():
        raise ConfigError(f"{output} exists; name a new folder for the average.")
    if STEP_FOLDER.match(output.name):
        raise ConfigError(f"{output}: a step-N name would be taken for the run's newest save on resume; name the "
                          "average otherwise (the default is step-N-averageK).")
    started = time.perf_counter()
    average: dict[str, torch.Tensor] = {}
    for group in _groups(weights):
        # one dcp.load per input and group of weights: DCP reads the checkpoint's metadata once per call
        totals = {key[len("model."):]: torch.zeros(weights[key], dtype=torch.float32) for key in group}
        loaded = {name: torch.empty_like(total) for name, total in totals.items()}
        for path in paths:
            dcp.load({"model": loaded}, checkpoint_id=str(path), no_dist=True)
            for name, total in totals.items():
                total += loaded[name]
        del loaded
        for name, total in totals.items():
            average[name] = total.div_(len(paths))
        if probe is not None:
            probe()
    newest = max(paths, key=lambda p: read_marker(p).get("step", -1))
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    dcp.save({"model": average}, checkpoint_id=str(partial), no_dist=True)
    if probe is not None:
        probe()
    marker = {**read_marker(newest), "model_only": True, "averaged_from": [str(p) for p in paths],
              "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(partial / MARKER, "w") as f:
        json.dump(marker, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    partial.rename(output)
    logger.info("checkpoint: averaged %d checkpoints (%s) into %s in %.1f s", len(paths),
                ", ".join(p.name for p in paths), output, time.perf_counter() - started)
    return output
