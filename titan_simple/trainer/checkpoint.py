"""Checkpoints on torch.distributed.checkpoint (DCP) for training: exact resume, any layout, atomic saves.

``CheckpointManager`` saves and restores everything a run needs to continue; ``TrainProgress`` is what the
trainer counts besides the stateful objects. The folder layout (``step-N`` / ``step-N.partial`` and its
``complete.json``), rank 0's writing of it (commit, prune) and the one-process readers (``load_model_weights``,
``export_hf``) live in ``checkpoint_files.py`` (re-exported here for the code that imports them from this
module); how a saved LR schedule is resumed, in ``optim.py`` (``load_lr_scheduler_position``).

Every rank writes its own shards into ``step-N.partial``; only after DCP has gathered every rank's result
(the coordinator writes ``.metadata`` last) does rank 0 write ``complete.json`` and rename the folder to
``step-N``. So a ``step-N`` folder with ``complete.json`` is whole, whatever was killed when.

The DCP state dict (nested keys are flattened by DCP: ``model.layers.0.attention.wq.weight``)::

    model         the model's own parameter names; sharded DTensors are written shard by shard, no gather
    optimizer     per-parameter state with flattened names, so it reshards like the model (PP included)
    lr_scheduler  the LambdaLR state
    dataloader    {"consumed_samples", "seq_len"}: the data position, global (data/sample_index.py); with a
                  mixture or stages also "mixture": the sources and shares, the samples each gave, and the
                  settings of the stages that have started (data/staged.py)
    train_state   step (the trainer's global_step), tokens_seen, and the dp size / world size it was saved with
    rng           {"rank_<r>": RNG states} of every rank

DCP reshards DTensors on load, so a checkpoint saved on one layout loads on any other. The data position is the
number of global samples consumed, so any layout and any global batch continue with exactly the samples not yet
seen (``_resume_data``). RNG states are restored only on the same world size.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_simple.core.optim import load_lr_scheduler_position
from titan_simple.data.staged import check_data_record, data_record
from titan_simple.errors import CheckpointError, ConfigError
from titan_simple.models.from_config import model_choice
from titan_simple.models.hf_llama import is_hf_folder
from titan_simple.models.llama3 import ModelArgs, Transformer
from titan_simple.parallel.simple_fsdp import sharded_parameters
from titan_simple.trainer.checkpoint_files import (
    EXPORT_DTYPES,
    MARKER,
    PARTIAL_SUFFIX,
    check_checkpoint,
    check_model_shapes,
    check_saved_model,
    check_saved_optimizer,
    commit_step,
    complete_steps,
    copy_hf_weights,
    export_hf,
    find_checkpoint,
    first_failure,
    fresh_partial_folder,
    load_model_weights,
    model_args_of,
    partial_folder,
    prune_steps,
    read_marker,
    read_metadata,
    read_model_weights,
    single_process_is_fine,
    step_folder,
)

# The file helpers are re-exported: generate.py, scripts/export_hf.py and the tests import them from here.
__all__ = [
    "EXPORT_DTYPES", "MARKER", "PARTIAL_SUFFIX", "STATE_KEYS", "CheckpointManager", "TrainProgress", "check_checkpoint",
    "complete_steps", "export_hf", "find_checkpoint", "load_model_weights", "model_args_of", "read_marker",
    "read_model_weights", "step_folder",
]

logger = logging.getLogger("titan_simple")

STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainProgress:
    """What the trainer counts and a checkpoint restores besides the stateful objects (saved as ``train_state``,
    the step under its key ``step``)."""

    global_step: int = 0
    tokens_seen: int = 0


def _pack(obj: Any) -> bytes:
    # Pickled by us so DCP stores one opaque blob instead of flattening lists of token ids into keys.
    return pickle.dumps(obj)


def _unpack(blob: Any) -> Any:
    return pickle.loads(blob)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _merged_view(model_parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the full model's, over all of this rank's pipeline stages.

    The stages keep full-model names (``layers.3...``), so merging their children (and the ``layers``
    ModuleDicts) gives the names a single model would have; the optimizer state is keyed by them.
    """
    if len(model_parts) == 1:
        return model_parts[0]
    view = nn.Module()
    for part in model_parts:
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict) and isinstance(view._modules.get(name), nn.ModuleDict):
                view._modules[name].update(child)
            elif name in view._modules:
                raise ValueError(f"pipeline stages both own module '{name}'")
            else:
                view._modules[name] = nn.ModuleDict(child) if isinstance(child, nn.ModuleDict) else child
    return view


# ------------------------------------------------------------------------------------ the manager


@dataclass
class _PendingSave:
    future: Future
    step: int
    model_only: bool
    started: float




class CheckpointManager:
    """Loads at start-up and saves every ``[checkpoint] interval`` steps, for one rank.

    ``load()`` once after everything is built; ``save(progress)`` after every step (it decides whether
    this step saves); ``close()`` at the end waits for an asynchronous save. Every rank calls each of them.
    """

    def __init__(
        self,
        config: Any,  # JobConfig
        *,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        dataloader: Any,
        model_args: ModelArgs,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        special_tokens: dict[str, int] | None = None,
    ) -> None:
        self.config = config.checkpoint
        self.folder = Path(config.job.dump_folder) / self.config.folder
        self.tokens_per_sample = config.training.seq_len
        self.model = _merged_view(model_parts)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.model_args = model_args
        self.model_choice = model_choice(config)  # the [model] keys, recorded in complete.json
        self.optimizer_name = config.optimizer.name  # whose state a checkpoint's must be to load into it
        self.special_tokens = special_tokens or {}  # bos_token_id / eos_token_id, for Hugging Face exports
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
        self.export_dtype = EXPORT_DTYPES[self.config.export_dtype]
        self._pending: _PendingSave | None = None
        self._last_saved_step = -1
        # Async saves run their collectives in a background thread: on a group of their own, or they would
        # interleave with the training step's collectives on the default group.
        self._async_group = (
            dist.new_group(backend="gloo") if self.config.async_mode == "async" and dist.is_initialized() else None
        )

    def latest_complete(self) -> Path | None:
        """The newest complete step folder on disk (for messages), or None."""
        steps = complete_steps(self.folder) if self.folder.exists() else []
        return step_folder(self.folder, steps[-1]) if steps else None

    # -------------------------------------------------------------------------------------- load

    def load(self) -> TrainProgress | None:
        """Restore the newest complete checkpoint (or ``load_step``), else ``initial_load_path``.

        Returns the progress to continue from, or None for a fresh start (weights from
        ``initial_load_path`` count as a fresh start unless it is loaded whole).
        """
        checkpoint_config = self.config
        if checkpoint_config.create_seed_checkpoint:
            if complete_steps(self.folder):
                raise ConfigError(f"[checkpoint] create_seed_checkpoint: {self.folder} already holds checkpoints; "
                                  "use an empty folder.")
            return None
        path = find_checkpoint(self.folder, checkpoint_config.load_step) if checkpoint_config.enable else None
        if path is not None:
            return self._load_dcp(path, model_only=False, resuming=True)
        if checkpoint_config.load_step >= 0:
            raise ConfigError(f"[checkpoint] load_step = {checkpoint_config.load_step} needs [checkpoint] "
                              "enable = true.")
        if not checkpoint_config.initial_load_path:
            if checkpoint_config.enable:
                logger.info("checkpoint: none in %s, starting from scratch", self.folder)
            return None
        initial = Path(checkpoint_config.initial_load_path)
        if is_hf_folder(initial):
            copy_hf_weights(initial, self.model, self.model_args)
            logger.info("checkpoint: loaded Hugging Face weights from %s (step 0)", initial)
            return None
        progress = self._load_dcp(initial, model_only=checkpoint_config.initial_load_model_only)
        return None if checkpoint_config.initial_load_model_only else progress

    def _expected_model_shapes(self) -> dict[str, torch.Size]:
        with torch.device("meta"):
            full_model = Transformer(self.model_args)
        return {k: v.shape for k, v in full_model.state_dict().items()}

    def _load_dcp(self, path: Path, model_only: bool, resuming: bool = False) -> TrainProgress:
        if not path.is_dir():
            raise ConfigError(f"[checkpoint] initial_load_path {path} does not exist.")
        started = time.perf_counter()
        metadata = read_metadata(path)
        check_model_shapes(metadata, self._expected_model_shapes(), path, self.model_choice)
        check_saved_model(path, self.model_args, resuming, self.model_choice)
        present = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        wanted = {"model"} if model_only else set(STATE_KEYS) - set(self.config.exclude_from_loading)
        if "optimizer" in wanted:
            check_saved_optimizer(metadata, path, self.optimizer_name)
        skipped = sorted(wanted - present - {"model"})
        if skipped and not model_only:
            logger.warning("checkpoint: %s holds no %s (a model-only checkpoint?): they start fresh",
                           path, ", ".join(skipped))
        wanted &= present

        saved = {"step": 0, "tokens_seen": 0, "dp_size": self.dp_size, "world_size": self.world_size}
        if "train_state" in present:  # tiny: read first, it decides what else to ask for
            train_state = {"train_state": dict.fromkeys(saved, 0)}
            self._dcp_load(train_state, path)
            saved = train_state["train_state"]

        state: dict[str, Any] = {}
        with sharded_parameters():
            state["model"] = get_model_state_dict(self.model)
            if "optimizer" in wanted:
                state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIMIZER_OPTIONS)
        if "lr_scheduler" in wanted:
            state["lr_scheduler"] = b""
        data_position = self._read_data_position(path, metadata, saved["step"]) if "dataloader" in wanted else None
        rng_key = f"rank_{self.rank}"
        same_world = saved["world_size"] == self.world_size
        if "rng" in wanted and same_world and f"rng.{rng_key}" in metadata.state_dict_metadata:
            state["rng"] = {rng_key: b""}
        self._dcp_load(state, path)

        with sharded_parameters():
            set_model_state_dict(self.model, state["model"])
            if "optimizer" in state:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_OPTIMIZER_OPTIONS)
        if "lr_scheduler" in state:
            load_lr_scheduler_position(self.lr_scheduler, self.optimizer, _unpack(state["lr_scheduler"]))
        self._restore_data_position(path, data_position, saved["tokens_seen"], "dataloader" in wanted, model_only)
        if "rng" in state:
            _set_rng_state(_unpack(state["rng"][rng_key]))
        elif "rng" in wanted:
            logger.info("checkpoint: saved on %d ranks, running on %d: RNG states are not restored",
                        saved["world_size"], self.world_size)
        progress = TrainProgress(global_step=saved["step"], tokens_seen=saved["tokens_seen"])
        if "train_state" not in wanted:
            progress = TrainProgress()  # excluded: count steps and tokens from 0 again
        logger.info("checkpoint: loaded %s from %s (step %d, %s) in %.1f s", ", ".join(sorted(state)), path,
                    progress.global_step, f"{progress.tokens_seen:,} tokens", time.perf_counter() - started)
        return progress

    def _restore_data_position(self, path: Path, position: dict[str, int] | None, tokens_seen: int, wanted: bool,
                               model_only: bool) -> None:
        """Where the data continues: the saved position, else (an older checkpoint) after tokens_seen."""
        if position is not None:
            self._resume_data(position["consumed_samples"], position["seq_len"], tokens_seen)
        elif wanted:
            logger.warning("checkpoint: %s has no data position (saved before the global sample index): the data "
                           "continues after tokens_seen / seq_len samples", path)
            self._resume_data(tokens_seen // self.tokens_per_sample, self.tokens_per_sample, tokens_seen)
        elif "dataloader" in self.config.exclude_from_loading and not model_only:
            logger.warning("checkpoint: dataloader state not loaded (exclude_from_loading): the data starts over "
                           "from the first sample")

    def _read_data_position(self, path: Path, metadata: Any, step: int) -> dict[str, Any] | None:
        """The saved data position (small: read on its own), None in a checkpoint saved before it existed; a
        mixture's or the stages' record is checked against this run's (``data/staged.check_data_record``)."""
        if "dataloader.consumed_samples" not in metadata.state_dict_metadata:
            return None
        data_state = {"dataloader": {"consumed_samples": 0, "seq_len": 0}}
        if "dataloader.mixture" in metadata.state_dict_metadata:
            data_state["dataloader"]["mixture"] = b""
        self._dcp_load(data_state, path)
        saved = data_state["dataloader"].get("mixture")
        check_data_record(path, _unpack(saved) if saved is not None else None, getattr(self._samples(), "index", None),
                          data_state["dataloader"], step)
        return data_state["dataloader"]

    def _dcp_load(self, state: dict[str, Any], path: Path) -> None:
        try:
            with single_process_is_fine():
                dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except (CheckpointException, Exception) as e:  # noqa: B014 -- CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint {path} cannot be read ({first_failure(e)}); it is corrupt or "
                              "truncated. Delete it to resume from the previous one.") from None

    def _samples(self) -> Any:
        """The loader's ``GlobalSamples`` (data/datasets.py), or None for a loader of another kind."""
        dataset = getattr(self.dataloader, "dataset", None)
        return dataset if hasattr(dataset, "resume_at") else None

    def _resume_data(self, consumed: int, seq_len: int, tokens_seen: int) -> None:
        """Continue with the first sample not yet consumed: exact on any layout and any global batch (the
        sample ids do not depend on them). Samples of another seq_len are other windows: continue after the
        same number of tokens instead."""
        samples = self._samples()
        if samples is None:
            return
        if seq_len != self.tokens_per_sample:
            consumed = tokens_seen // self.tokens_per_sample
            logger.warning("checkpoint: saved with seq_len %d, running with %d: the data continues after the same "
                           "number of tokens (%s), in windows of the new length", seq_len, self.tokens_per_sample,
                           f"{tokens_seen:,}")
        samples.resume_at(consumed)

    # -------------------------------------------------------------------------------------- save

    def save(self, progress: TrainProgress, *, last: bool = False, force: bool = False, write: bool = True) -> None:
        """Save if this step is due (every ``interval`` steps, the last step, or ``force``, e.g. on SIGTERM).

        Call every step on every rank: it also commits a finished asynchronous save. ``write=False``: only that
        (fault tolerance: another replica group writes this step's checkpoint).
        """
        self._commit_if_done()
        checkpoint_config, step = self.config, progress.global_step
        if not write or not checkpoint_config.enable or step == self._last_saved_step:
            return
        if not (force or last or step % checkpoint_config.interval == 0):
            return
        model_only = last and checkpoint_config.last_save_model_only
        self._wait_for_pending()
        # The last save and a save on a stop request must be on disk before the process exits: synchronous.
        asynchronous = checkpoint_config.async_mode == "async" and not (last or force)
        self._write(progress, model_only=model_only, asynchronous=asynchronous)
        if last and checkpoint_config.last_save_in_hf:
            self._wait_for_pending()
            self._export_last_hf(step)

    def save_seed(self) -> None:
        """``create_seed_checkpoint``: the freshly initialized model alone, as step 0."""
        self._write(TrainProgress(), model_only=True, asynchronous=False)

    def close(self) -> None:
        """Wait for an asynchronous save and commit it (every rank)."""
        self._wait_for_pending()

    def _state_for_save(self, progress: TrainProgress, model_only: bool) -> dict[str, Any]:
        with sharded_parameters():
            model = get_model_state_dict(self.model)
            if model_only and self.export_dtype != torch.float32:
                model = {k: v.to(self.export_dtype) for k, v in model.items()}
            state: dict[str, Any] = {"model": model}
            if not model_only:
                state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIMIZER_OPTIONS)
        state["train_state"] = {"step": progress.global_step, "tokens_seen": progress.tokens_seen,
                                "dp_size": self.dp_size, "world_size": self.world_size}
        if not model_only:
            state["lr_scheduler"] = _pack(self.lr_scheduler.state_dict())
            samples = self._samples()
            if samples is not None:  # the same on every rank
                state["dataloader"] = {"consumed_samples": samples.consumed, "seq_len": self.tokens_per_sample}
                if (record := data_record(samples.index, samples.consumed)) is not None:  # mixture, stages
                    state["dataloader"]["mixture"] = _pack(record)
            state["rng"] = {f"rank_{self.rank}": _pack(_rng_state())}
        return state

    def _write(self, progress: TrainProgress, *, model_only: bool, asynchronous: bool) -> None:
        step = progress.global_step
        partial = partial_folder(self.folder, step)
        started = time.perf_counter()
        error = None
        if self.rank == 0:  # a stale folder of a crashed save of this step goes first
            try:
                fresh_partial_folder(self.folder, step)
            except OSError as e:
                error = e
        if not self._everyone_ok(error is None):
            raise self._save_error(step, error or "rank 0 could not create the folder")
        state = self._state_for_save(progress, model_only)
        try:
            if asynchronous:
                # The state is copied to CPU memory before async_save returns (its default stager), so the
                # next optimizer step can change the parameters while the copy is written.
                with single_process_is_fine():
                    future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._async_group)
                self._pending = _PendingSave(future, step, model_only, started)
                logger.info("checkpoint: saving step %d in the background (staged in %.2f s)", step,
                            time.perf_counter() - started)
            else:
                with single_process_is_fine():
                    dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
                if self.rank == 0:
                    self._commit(step, model_only, started)
                if dist.is_initialized():
                    dist.barrier()  # the step folder exists for everyone once save() returns
        except (CheckpointException, OSError) as e:
            raise self._save_error(step, e) from None
        self._last_saved_step = step

    def _everyone_ok(self, ok: bool) -> bool:
        if not dist.is_initialized():
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def _save_error(self, step: int, error: BaseException | str) -> CheckpointError:
        cause = first_failure(error) if isinstance(error, BaseException) else error
        steps = complete_steps(self.folder)
        previous = f"the newest complete one is {step_folder(self.folder, steps[-1])}" if steps else "none is complete"
        return CheckpointError(f"checkpoint: saving step {step} to {self.folder} failed ({cause}); older checkpoints "
                           f"are untouched, {previous}. Free disk space or fix permissions, then resume.")

    def _commit(self, step: int, model_only: bool, started: float) -> None:
        """Rank 0, once every rank's shards and DCP's .metadata are written: mark complete, rename, prune."""
        marker = {
            "step": step, "model_only": model_only, "world_size": self.world_size, "dp_size": self.dp_size,
            "model_args": dataclasses.asdict(self.model_args), "model": self.model_choice,
            "special_tokens": self.special_tokens,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        final = commit_step(self.folder, step, marker)
        size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
        logger.info("checkpoint: saved step %d%s to %s (%.1f MB) in %.1f s", step,
                    " (model only)" if model_only else "", final, size / 1e6, time.perf_counter() - started)
        prune_steps(self.folder, self.config.keep_latest_k)

    def _commit_if_done(self) -> None:
        """Rank 0 commits a finished background save as soon as it sees it; failures wait for the next
        collective point (``_wait_for_pending``) so that every rank raises together."""
        pending = self._pending
        if pending is None or not pending.future.done() or pending.future.exception() is not None:
            return
        if self.rank == 0:
            self._commit(pending.step, pending.model_only, pending.started)
        self._pending = None

    def _wait_for_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            pending.future.result()
        except (CheckpointException, Exception) as e:  # noqa: B014 -- CheckpointException is a BaseException
            self._pending = None
            raise self._save_error(pending.step, e) from None
        self._commit_if_done()

    def _export_last_hf(self, step: int) -> None:
        final = step_folder(self.folder, step)
        if self.rank == 0:
            out = export_hf(final, final / "hf", dtype=self.export_dtype, args=self.model_args,
                            special_tokens=self.special_tokens)
            logger.info("checkpoint: exported the model in Hugging Face format to %s", out)
        if dist.is_initialized():
            dist.barrier()
