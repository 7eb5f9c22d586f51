"""The on-disk checkpoint format, and reading a checkpoint's model without the training machinery.

Under ``<job.dump_folder>/<checkpoint.folder>/``::

    step-8/               complete: DCP files (.metadata, __<rank>_0.distcp) and complete.json
    step-12.partial/      a save in progress, or one that never finished: ignored (with a warning)

A ``step-N`` folder with ``complete.json`` (``MARKER``) is whole, whatever was killed when: the writer
(``checkpoint.CheckpointManager``) fills ``step-N.partial`` and renames it only after every rank's shards and
DCP's ``.metadata`` are on disk. This module knows that layout -- which steps are complete
(``complete_steps``, ``find_checkpoint``), the marker (``read_marker``, ``model_args_of``), the DCP metadata
and its check against a model's shapes, and rank 0's side of a save (``fresh_partial_folder``, ``commit_step``,
``prune_steps``; the manager decides when) -- and uses it for the one-process consumers that need no optimizer,
data loader or process group: ``load_model_weights`` (generation, evaluation: ``check_checkpoint`` before the model
is built, then ``read_model_weights``), ``export_hf`` (a step folder to a Hugging Face folder) and
``copy_hf_weights`` (Hugging Face weights into a plain or sharded model). The comparison of the model a step's
complete.json recorded with the one loading it (``check_saved_model``) is the trainer's too. It is
apart from ``checkpoint.py`` so that those consumers read a checkpoint without the manager's save / resume
logic, and so that the manager's file stays about resuming a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_simple.errors import CheckpointError, ConfigError
from titan_simple.models.hf_files import check_export_target, refuse_other_weight_formats
from titan_simple.models.hf_llama import (
    check_hf_folder,
    is_hf_folder,
    load_hf,
    model_changes,
    model_differences,
    save_hf,
)
from titan_simple.models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer
from titan_simple.parallel.simple_fsdp import sharded_parameters

logger = logging.getLogger("titan_simple")

MARKER = "complete.json"
PARTIAL_SUFFIX = ".partial"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


# ------------------------------------------------------------------------------------------ folders


def step_folder(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def complete_steps(folder: str | Path, warn: bool = False) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending. ``warn`` logs every partial one."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for entry in sorted(folder.iterdir()):
        match = _STEP_FOLDER.match(entry.name)
        if match and (entry / MARKER).is_file():
            steps.append(int(match.group(1)))
        elif warn and entry.is_dir() and (match or entry.name.endswith(PARTIAL_SUFFIX)):
            logger.warning("checkpoint: ignoring %s: not complete (no %s): a save still in progress, or one that did "
                           "not finish", entry, MARKER)
    return sorted(steps)


def find_checkpoint(folder: str | Path, step: int = -1) -> Path | None:
    """The complete checkpoint of ``step`` (-1: the newest) in ``folder``; None if there is none at all.

    A requested step that is missing or incomplete raises ConfigError listing the complete ones.
    """
    steps = complete_steps(folder, warn=True)
    if step < 0:
        return step_folder(folder, steps[-1]) if steps else None
    if step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise ConfigError(f"[checkpoint] load_step = {step}: no complete checkpoint {step_folder(folder, step)} "
                          f"(complete steps in {folder}: {available}).")
    return step_folder(folder, step)


def partial_folder(folder: str | Path, step: int) -> Path:
    """Where a save of ``step`` is written until it is complete."""
    return Path(folder) / f"step-{step}{PARTIAL_SUFFIX}"


def fresh_partial_folder(folder: str | Path, step: int) -> Path:
    """An empty ``step-N.partial`` for a new save of ``step``; a stale one (a crashed save of this step) goes
    first. Rank 0, before any rank writes."""
    partial = partial_folder(folder, step)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit_step(folder: str | Path, step: int, marker: dict[str, Any]) -> Path:
    """Mark ``step-N.partial`` complete (``complete.json``, synced to disk) and rename it to ``step-N``, replacing
    an existing one; returns the step folder. Rank 0, once every rank's shards and DCP's .metadata are written."""
    partial = partial_folder(folder, step)
    with open(partial / MARKER, "w") as f:
        json.dump(marker, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    final = step_folder(folder, step)
    if final.exists():  # e.g. a run resumed from an earlier step reaches this step again
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced)
        logger.warning("checkpoint: replaced the existing %s", final)
    else:
        partial.rename(final)
    return final


def prune_steps(folder: str | Path, keep_latest_k: int) -> None:
    """Keep the newest ``keep_latest_k`` complete checkpoints (0 = all); the newest always survives."""
    steps = complete_steps(folder)
    if keep_latest_k <= 0 or len(steps) <= keep_latest_k:
        return
    for step in steps[:-keep_latest_k]:
        shutil.rmtree(step_folder(folder, step), ignore_errors=True)
        logger.info("checkpoint: deleted step %d (keep_latest_k = %d)", step, keep_latest_k)


def read_marker(path: str | Path) -> dict[str, Any]:
    """The ``complete.json`` of a step folder ({} when absent, e.g. a DCP folder written elsewhere)."""
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text()) if marker.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is unreadable ({e}); the checkpoint is corrupt.") from None


def read_metadata(path: Path) -> Metadata:
    if not (path / ".metadata").is_file():
        refuse_other_weight_formats(path)
        raise ConfigError(f"checkpoint {path} is not a DCP checkpoint (no .metadata file); point at a step-N "
                          "folder or a Hugging Face folder (config.json + *.safetensors).")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling a truncated file raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"checkpoint {path}: .metadata is unreadable ({type(e).__name__}: {e}); "
                          "the checkpoint is corrupt.") from None


# The state a kind of optimizer keeps per parameter (its key in the flattened optimizer state dict).
OPTIMIZER_STATE = {"Muon": "momentum_buffer", "AdamW or Adam": "exp_avg"}


def saved_optimizer(metadata: Metadata) -> str | None:
    """The kind of optimizer whose state a checkpoint holds (Muon keeps a momentum buffer for its matrices, AdamW and
    Adam two moments for every parameter), or None without optimizer state."""
    keys = [key for key in metadata.state_dict_metadata if key.startswith("optimizer.state.")]
    for kind, state in OPTIMIZER_STATE.items():
        if any(key.endswith(f".{state}") for key in keys):
            return kind
    return None


def check_saved_optimizer(metadata: Metadata, path: Path, name: str) -> None:
    """The one-line ConfigError of a checkpoint whose optimizer state another optimizer kept than ``name``
    (``[optimizer] name``): its state cannot be loaded, and the fix says how to resume without it."""
    saved = saved_optimizer(metadata)
    mine = "Muon" if name == "Muon" else "AdamW or Adam"
    if saved is None or saved == mine:
        return
    raise ConfigError(f"checkpoint {path} holds the optimizer state of {saved} and this run's [optimizer] name is "
                      f"{name!r}, whose state differs; resume without the saved optimizer state with "
                      "--checkpoint.exclude_from_loading '[\"optimizer\"]' (the model, schedule, data position and "
                      "RNG still load), or set [optimizer] name back.")


def check_model_shapes(metadata: Metadata, expected: dict[str, torch.Size], path: Path,
                       choice: dict | None = None) -> None:
    """ConfigError unless the checkpoint's "model" entries are exactly ``expected`` (names and shapes); the fix
    names the model the checkpoint was saved by, as far as it differs from ``choice`` (see ``saved_model_fix``)."""
    saved = {
        key.removeprefix("model."): item.size for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [f"{k} {list(saved[k])} vs model {list(expected[k])}" for k in sorted(set(saved) & set(expected))
                  if tuple(saved[k]) != tuple(expected[k])]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
        if items:
            problems.append(f"{len(items)} {label} ({', '.join(items[:3])}{', ...' if len(items) > 3 else ''})")
    if problems:
        raise ConfigError(f"checkpoint {path} does not match the model: {'; '.join(problems)}; build the model "
                          f"it was saved by: {saved_model_fix(path, choice)}.")


def _flavor_choice(saved: ModelArgs) -> dict | None:
    """The [model] keys (``hf_llama.MODEL_KEYS``) building ``saved`` from a flavor, overrides included, or None."""
    for name, flavor in LLAMA3_FLAVORS.items():
        for rope in (flavor.rope_scaling, None):
            candidate = dataclasses.replace(flavor, n_layers=saved.n_layers, rope_scaling=rope)
            if not model_differences(saved, candidate):
                return {"flavor": name, "rope_scaling": "none" if rope is None and flavor.rope_scaling else None,
                        "n_layers": saved.n_layers if saved.n_layers != flavor.n_layers else None}
    return None


def saved_model_fix(path: Path, choice: dict | None = None) -> str:
    """The [model] settings that build the model a step folder was saved by, as far as they differ from ``choice``
    (the config's, ``from_config.model_choice``; None: unknown): the keys its complete.json records, else the
    flavor and overrides its recorded shape fits, else the advice to use the run's own."""
    marker = read_marker(path)
    target = marker.get("model")
    if not isinstance(target, dict) and marker.get("model_args"):  # saved before complete.json recorded the keys
        target = _flavor_choice(ModelArgs(**marker["model_args"]))
    changes = model_changes(choice or {}, target) if isinstance(target, dict) else ""
    return changes or "the [model] flavor or hf_config (and overrides) of the run that wrote it"


def check_saved_model(path: Path, args: ModelArgs, resuming: bool, choice: dict | None = None) -> None:
    """The model a checkpoint was saved by (its complete.json) must compute what ``args`` does: resuming stops on
    any difference of RoPE, norm epsilon or tying (shapes are checked from the DCP metadata); loading its weights
    otherwise (``initial_load_path``, generation, export) only warns of RoPE and epsilon changes, which
    long-context recipes make on purpose. Tying never changes silently: loaded into a tied model, separate
    embedding and output weights would overwrite each other. The fix names the saved model's settings as far as
    they differ from ``choice``, the config's [model] keys (``from_config.model_choice``)."""
    saved = model_args_of(path)
    if saved is None:
        return
    fields = ("rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings")
    changed = [d for d in model_differences(saved, args, "this run") if d.split(" ", 1)[0] in fields]
    if not changed:
        return
    what = f"checkpoint {path} was saved by a model that computes otherwise: {'; '.join(changed)}"
    if saved.tie_word_embeddings != args.tie_word_embeddings:
        raise ConfigError(f"{what}. Tying cannot change on load (a tied model has one weight for the embedding and "
                          f"the output projection); build the model it was saved by: {saved_model_fix(path, choice)}.")
    if resuming:
        hint = (" The 8B, 70B and 405B flavors scale RoPE since they became Llama 3.1's: set --model.rope_scaling "
                "none to continue a run saved before." if saved.rope_scaling is None else "")
        raise ConfigError(f"{what}.{hint} To continue it, build the model it was saved by "
                          f"({saved_model_fix(path, choice)}); to change them on purpose, start a new run from it "
                          "with [checkpoint] initial_load_path.")
    logger.warning("%s: starting from its weights with this run's settings", what)


def first_failure(error: BaseException) -> str:
    """One line from a DCP CheckpointException (which lists every rank's traceback) or any exception."""
    where = ""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _trace) = min(error.failures.items(), key=lambda item: item[0])
        where = f"rank {rank}: "
    text = str(error).splitlines()[0] if str(error) else "the file ends early"
    return f"{where}{type(error).__name__}: {text}"


@contextlib.contextmanager
def single_process_is_fine() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a layout we support on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ------------------------------------------------------------------------------------ plain models


def resolve_checkpoint(checkpoint_dir: str | Path) -> Path:
    """The folder a one-process reader reads: a Hugging Face folder, a complete ``step-N`` folder, or a checkpoint
    folder's newest complete step; or the ConfigError line (missing, partial, weights we cannot read)."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist.")
    refuse_other_weight_formats(path)
    if is_hf_folder(path):
        return path
    if not (path / ".metadata").is_file() and complete_steps(path):
        return find_checkpoint(path)
    if path.name.endswith(PARTIAL_SUFFIX) or (_STEP_FOLDER.match(path.name) and not (path / MARKER).is_file()):
        raise ConfigError(f"checkpoint {path} is partial (its save did not finish); use a complete step folder.")
    return path


def check_checkpoint(checkpoint_dir: str | Path, args: ModelArgs | None, shapes: dict[str, torch.Size] | None = None,
                     choice: dict | None = None, model_name: str = "model") -> Path:
    """Everything about a checkpoint that can be checked before its model is built, as the trainer checks it: a
    Hugging Face folder's config and files (``hf_llama.check_hf_folder``), a DCP folder's shapes against
    ``shapes`` (default: ``args``'s model) and the model its complete.json recorded against ``args``
    (``check_saved_model``, as ``initial_load_path`` does: tying refused, RoPE / epsilon changes warned).
    ``choice``: the config's [model] keys, for the fix (``from_config.model_choice``); ``model_name``: how messages
    name the model. Returns the folder to read."""
    path = resolve_checkpoint(checkpoint_dir)
    if is_hf_folder(path):
        if args is None:
            raise ConfigError(f"Hugging Face weights {path} can only be loaded into a Llama Transformer.")
        check_hf_folder(path, args, model_name, choice)
        return path
    if shapes is None:
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    check_model_shapes(read_metadata(path), shapes, path, choice)
    if args is not None:
        check_saved_model(path, args, resuming=False, choice=choice)
    return path


def read_model_weights(path: Path, model: nn.Module) -> None:
    """The weights of a folder ``check_checkpoint`` returned, into a plain (unsharded) ``model``."""
    if is_hf_folder(path):
        copy_hf_weights(path, model)
        return
    state_dict = model.state_dict()
    try:
        with single_process_is_fine():
            dcp.load({"model": state_dict}, checkpoint_id=str(path), no_dist=True)
    except (CheckpointException, Exception) as e:  # noqa: B014 -- CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be read ({first_failure(e)}); it is corrupt or "
                              "truncated.") from None
    model.load_state_dict(state_dict)  # no-op for in-place loads; makes copies (other dtypes) stick


def load_model_weights(checkpoint_dir: str | Path, model: nn.Module, choice: dict | None = None) -> None:
    """Load the model weights of a checkpoint into a plain (unsharded) ``model``, in one process.

    ``checkpoint_dir``: a ``step-N`` folder, a checkpoint folder (its newest complete step is used), or a
    Hugging Face Llama folder (``model`` must then be our ``Transformer``). Works with or without a process
    group; the weights are resharded from whatever layout saved them. Raises ConfigError on a missing,
    partial, corrupt or mismatched checkpoint, or one saved by a model with other tying; warns when it was saved
    with other RoPE or epsilon (``check_checkpoint``, as the trainer's ``initial_load_path``).
    """
    args = getattr(model, "args", None)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    read_model_weights(check_checkpoint(checkpoint_dir, args, shapes, choice), model)


def model_args_of(checkpoint_dir: str | Path) -> ModelArgs | None:
    """The model shape a step folder was saved with (from its complete.json), if recorded."""
    args = read_marker(checkpoint_dir).get("model_args")
    return ModelArgs(**args) if args else None


def export_hf(checkpoint_dir: str | Path, output_dir: str | Path, dtype: torch.dtype = torch.float32,
              args: ModelArgs | None = None, special_tokens: dict[str, int] | None = None) -> Path:
    """Write the model of a DCP step folder as a Hugging Face Llama folder (one process, full weights), replacing a
    weight set the folder holds whole (``hf_llama.save_hf``). ``args`` and ``special_tokens`` (BOS / EOS ids)
    default to what the step's complete.json recorded."""
    check_export_target(output_dir, source=checkpoint_dir)  # before the weights are read
    recorded = model_args_of(checkpoint_dir)
    args = args or recorded
    if args is not None and recorded is not None and (wrong := model_differences(args, recorded, "complete.json")):
        raise ConfigError(f"checkpoint {checkpoint_dir} was saved by a model that computes otherwise than the one "
                          f"given for its export: {'; '.join(wrong)}. Export it with the model its complete.json "
                          "records (scripts/export_hf.py: leave --flavor out; --flavor is for a DCP folder without "
                          "complete.json).")
    if special_tokens is None:
        special_tokens = read_marker(checkpoint_dir).get("special_tokens")
    if args is None:
        raise ConfigError(f"checkpoint {checkpoint_dir} records no model shape; pass the flavor explicitly.")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    load_model_weights(str(checkpoint_dir), model)
    return save_hf(model.state_dict(), args, output_dir, dtype=dtype, special_tokens=special_tokens)


def copy_hf_weights(folder: Path, model: nn.Module, args: ModelArgs | None = None) -> None:
    """Copy Hugging Face weights into ``model``, plain or sharded (each rank keeps its slice of each)."""
    args = args or getattr(model, "args", None)
    if args is None:
        raise ConfigError(f"Hugging Face weights {folder} can only be loaded into a Llama Transformer.")
    with torch.no_grad(), sharded_parameters():
        params = dict(model.named_parameters())
        loaded = set()
        for name, full in load_hf(folder, args):
            if name not in params:  # another pipeline stage's weight
                continue
            param = params[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ConfigError(f"Hugging Face weights {folder}: {name} has shape {list(full.shape)}, the model "
                                  f"{list(param.shape)}.")
            full = full.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ConfigError(f"Hugging Face weights {folder} lack {len(missing)} weights ({', '.join(missing[:3])}).")

