"""The average of several checkpoints' model weights, written as a step folder of its own.

    average_checkpoints([".../step-80", ".../step-90", ".../step-100"], ".../step-100-average3")

The Llama 3 paper averages the checkpoints of its annealing phase into the released model. Each input is a
complete step folder of one run (any layout: DCP reshards on load); the output is a model-only DCP folder with a
``complete.json`` like any save's (the newest input's, plus ``averaged_from``), so ``--checkpoint.initial_load_path``,
``scripts/generate.py`` and ``scripts/export_hf.py`` read it as they read a step folder. Its name is not
``step-N``: the run's resume never mistakes it for its newest save.

Streaming: one fp32 running sum per weight, filled one weight and one input at a time (one ``dcp.load`` of one
key), so the process holds one copy of the model plus one weight, whatever the number of inputs.
"""

from __future__ import annotations

import json
import logging
import os
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


def _model_weights(path: Path) -> dict[str, torch.Size]:
    """The model's weights a step folder holds: DCP key (``model.<name>``) -> shape."""
    return {key: meta.size for key, meta in read_metadata(path).state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def check_inputs(folders: Sequence[str | Path]) -> tuple[list[Path], dict[str, torch.Size]]:
    """The step folders to average, checked before anything is read: at least two, complete, of one run (the
    same checkpoint folder) and one model (the model recorded in complete.json, the weights' names and shapes)."""
    if len(folders) < 2:
        raise ConfigError(f"averaging needs at least two step folders, got {len(folders)}.")
    paths = [resolve_checkpoint(folder) for folder in folders]
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


def average_checkpoints(folders: Sequence[str | Path], output: str | Path,
                        probe: Callable[[], None] | None = None) -> Path:
    """Average the model weights of ``folders`` into the new folder ``output``; returns it. Refuses in one line
    (ConfigError) inputs of several runs or models, and an ``output`` that exists. ``probe`` is called after each
    weight's sum and after the save (the script samples its memory there)."""
    paths, weights = check_inputs(folders)
    output = Path(output)
    if output.exists():
        raise ConfigError(f"{output} exists; name a new folder for the average.")
    started = time.perf_counter()
    average: dict[str, torch.Tensor] = {}
    for key, shape in weights.items():
        name = key[len("model."):]
        total = torch.zeros(shape, dtype=torch.float32)
        one = torch.empty(shape, dtype=torch.float32)
        for path in paths:
            dcp.load({"model": {name: one}}, checkpoint_id=str(path), no_dist=True)
            total += one
        average[name] = total.div_(len(paths))
        del one
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
