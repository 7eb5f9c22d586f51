"""Fault-tolerant replica groups on torchft: a job that keeps training when a group of ranks dies.

The data-parallel world is ``[fault_tolerance] group_size`` replica groups. Each group is its own torchrun job
with the same config (SimpleFSDP, TP, PP inside, exactly as without fault tolerance) and its own
``replica_id``; torchft's lighthouse (one process for the whole job) forms a quorum of the live groups every
step, and torchft's ``Manager`` joins them. ``ReplicaGroups`` is a feature of the loop (``LoopFeature``) and of
the step (``StepFeature``); the trainer and the step call its hooks and name it nowhere:

    before_step()       quorum with the live groups (sync): a group that is behind receives this rank's
                        shards, the optimizer state, the schedule and the progress from a live peer first
    forward / backward  inside the group, compiled or eager, SimpleFSDP's own reduce-scatter / all-reduce
    average()           the group's gradient shards (and the loss) averaged across the live groups: rank r of
                        every group all-reduces with rank r of the others, in buckets, outside the compiled graph
    should_commit()     every group agrees the step went through; only then the optimizer and schedule step

A group that dies mid-step makes the others' all-reduce fail: that step is not committed and is retried (the
same rows) with the groups still alive. A dead group's rows of the global batch are skipped, not re-read: the
global batch order stays the one the configured world would read (``data/sample_index.py``), the survivors read
their own rows and the dead group's rows of those steps are never seen. The quorum is synchronous (torchft's
``use_async_quorum=False``), so a healing group has its new state before its forward and takes part in that
step; the price is one lighthouse round trip per step before the forward.

**Healing** sends a live rank's shards to the healing rank over the replica groups' own process group (torchft's
``PGTransport``: NCCL from GPU to GPU into the live tensors, gloo on CPU), within a recovery timeout derived from
the state's size (``recovery_timeout``). **The cross-group average** reduces the gradient shards where they live:
on the first step they move into one flat buffer per dtype and stay there (autograd accumulates into those views
and the optimizer zeroes them in place), so every step all-reduces slices of it with no copy (``GradientBuckets``).
**On NCCL** the replica group's communicators abort on a peer's error instead of tearing down the process
(``replica_process_group``): a surviving group lives on and torchft configures the next quorum's group.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch

from titan_simple.core.step_feature import StepFeature
from titan_simple.errors import ConfigError, LighthouseLost
from titan_simple.trainer.loop_feature import LoopFeature, Progress
from titan_simple.trainer.metrics import LIVE_GROUPS
from titan_simple.trainer.replica_state import GradientBuckets, ReplicaState, recovery_timeout, state_bytes

if TYPE_CHECKING:  # the assembly imports the model and the parallelisms
    from titan_simple.core.assemble import Run

logger = logging.getLogger("titan_simple")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Rehearsals (scripts/fault_tolerance.py sets it): "between:N" pauses every rank of this group once it has committed
# step N or later, before the next quorum; "allreduce:N" inside the next step's cross-group all-reduce, after its
# first bucket. A paused rank writes <group folder>/failure_point.rank<r> and waits to be killed (the launcher's
# --kill). "hold:N": from step N on, this group steps only with every group live (the launcher's --hold: a restarted
# group rejoins before a short run ends).
FAILURE_ENV = "TITAN_SIMPLE_FT_FAIL"


def group_folder(dump_folder: str, replica_id: int) -> str:
    """Where a group writes its metrics, TensorBoard and status (checkpoints stay shared in dump_folder)."""
    return os.path.join(dump_folder, f"replica_{replica_id}")


def log_folder(config: Any) -> str:
    """Where a run writes its metrics, TensorBoard and run status: ``[job] dump_folder``, or its replica group's
    folder in it with fault tolerance."""
    ft = config.fault_tolerance
    return group_folder(config.job.dump_folder, ft.replica_id) if ft.enable else config.job.dump_folder


def lighthouse_address(config: Any) -> str:
    """``[fault_tolerance] lighthouse`` or ``$TORCHFT_LIGHTHOUSE``; one line if neither is set."""
    address = config.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(f"[fault_tolerance] enable needs a lighthouse: set [fault_tolerance] lighthouse (e.g. "
                          f"http://host:29510) or {LIGHTHOUSE_ENV}, after starting `torchft_lighthouse "
                          "--min_replicas 1` on one machine.")
    return address if "://" in address else f"http://{address}"


def check_fault_tolerance(config: Any, dims: Any, environ: dict[str, str] | None = None) -> str:
    """The layout and environment checks (one line each, before anything expensive); returns the lighthouse
    address. ``dims``: the ParallelDims of one group."""
    environ = dict(os.environ) if environ is None else environ
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        raise ConfigError(
            "[fault_tolerance] enable with hybrid_shard (data_parallel_replicate_degree = "
            f"{dims.dp_replicate} x data_parallel_shard_degree = {dims.dp_shard}): the replicate dimension cannot "
            "lose a member. Make each replica group one fully_shard group (data_parallel_replicate_degree = 1) and "
            "let the replica groups replicate: as many groups as replicas."
        )
    # torchft's Rust side logs every quorum and commit at INFO; its level is read once, when torchft loads.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("[fault_tolerance] enable needs torchft: pip install -e '.[ft]' (scripts/setup.sh "
                          "installs it).") from None
    if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        raise ConfigError("[fault_tolerance] enable needs torchrun (torchft keeps its group state in torchrun's "
                          "store): run each replica group as torchrun --nproc_per_node=N train.py ..., even for N = 1.")
    address = lighthouse_address(config)
    check_reachable(address)
    return address


def check_reachable(address: str, timeout_seconds: float = 5.0) -> None:
    """One line if nothing listens at the lighthouse address."""
    parts = urlsplit(address)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"[fault_tolerance] lighthouse {address!r} is not an address like http://host:29510.")
    try:
        socket.create_connection((host, port), timeout=timeout_seconds).close()
    except OSError as error:
        raise ConfigError(
            f"[fault_tolerance] lighthouse {address} cannot be reached ({error.strerror or error}); start it "
            "first (torchft_lighthouse --min_replicas 1 --bind [::]:29510, or scripts/fault_tolerance.py) or fix "
            "[fault_tolerance] lighthouse."
        ) from None


# ------------------------------------------------------------------------------------------- groups


# NCCL's error handling for torchft's replica group: 2 (CleanUpOnly) aborts a failed communicator and lets the process
# live, so torchft configures the next quorum's group. Our own groups keep 3 (trainer/distributed.py), under which
# torch's watchdog ends the process on a communicator error: a peer group's death would take the survivors with it.
REPLICA_NCCL_ERROR_HANDLING = "2"
_ENVIRONMENT_LOCK = threading.Lock()  # torchft builds its groups on its quorum thread


def replica_nccl_group_class() -> type:
    """torchft's reconfigurable ``ProcessGroupNCCL`` whose communicators are built with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING = REPLICA_NCCL_ERROR_HANDLING``: torch reads the variable in each group's
    constructor, so it is set around that call only (``ProcessGroupNCCL.Options`` has no field for it)."""
    from torchft.process_group import ProcessGroupNCCL

    class ReplicaProcessGroupNCCL(ProcessGroupNCCL):
        def _create_pg(self, store, rank: int, world_size: int):
            with _ENVIRONMENT_LOCK:
                previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = REPLICA_NCCL_ERROR_HANDLING
                try:
                    return super()._create_pg(store, rank, world_size)
                finally:
                    if previous is None:
                        del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
                    else:
                        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = previous

    return ReplicaProcessGroupNCCL


def replica_process_group(device: torch.device, timeout: timedelta) -> Any:
    """The group that links rank r of every live replica group: NCCL on GPUs (``replica_nccl_group_class``), gloo on
    CPU; ``timeout`` bounds each of its operations."""
    if device.type == "cuda":
        return replica_nccl_group_class()(timeout=timeout)
    from torchft.process_group import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timeout)


class ReplicaGroups(StepFeature, LoopFeature):
    """This rank's view of the replica groups: torchft's Manager over a reconfigurable process group that links
    rank r of every live group. A step feature (``core/step.py``): after backward it averages the gradients
    over the live groups, and the step commits only when every group completed it. A loop feature
    (``trainer/loop_feature.py``): it connects after the checkpoint is loaded, joins each step's quorum (and heals
    there), counts every live group's tokens, and lets one group write the shared checkpoints."""

    keeps_gradient_buffers = True  # the average runs in the gradients' own buffer (GradientBuckets)

    def __init__(self, config: Any, *, rank: int, world_size: int, device: torch.device, lighthouse: str,
                 dump_folder: str) -> None:
        ft = config.fault_tolerance
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # torchft logs every step at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        # A heal sends its metadata with torch.frombuffer on bytes, which warns on every heal; it only reads them.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        if device.type != "cuda":  # every new quorum warns that NCCL's flight recorder (absent here) was not reset
            logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())
        self.group_size = ft.group_size
        self.lighthouse = lighthouse
        self.gradients = GradientBuckets(int(ft.bucket_cap_mb * 2**20), in_bf16=ft.allreduce_in_bf16)
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.dump_folder = dump_folder
        self.healed: Progress | None = None
        self.committed_steps = 0  # before the step in flight
        self.uncommitted_steps = 0  # steps abandoned because a peer group failed during them, since start-up
        self.first_quorum = True
        self.quorum_timeout_seconds = ft.quorum_timeout_seconds
        self.live_groups = 0
        self.quorum_seconds = 0.0  # of the last before_step: a stall waiting for a quorum, or a heal, shows here
        self.allreduce_seconds = 0.0  # of the last average()

    def step_features(self) -> list[StepFeature]:
        return [self]

    def after_restore(self, run: Run, progress: Callable[[], Progress]) -> None:
        """Join the replica groups with the run's state, as restored: the quorum compares the groups' steps."""
        params = [p for part in run.parts.modules for p in part.parameters()]
        self.connect(ReplicaState(params, run.optimizer, run.lr_scheduler, progress))

    def connect(self, state: ReplicaState) -> None:
        """Join the lighthouse with this rank's ``state`` (after the checkpoint is loaded into it)."""
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        ft, device, rank, world_size = self.config.fault_tolerance, self.device, self.rank, self.world_size
        lighthouse, dump_folder = self.lighthouse, self.dump_folder
        self.state = state
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = replica_process_group(device, timeout)
        # The whole heal (and the manager's other waits) may take the transfer of this rank's state at the slowest
        # allowed rate; each operation of the group still fails after `timeout`, and so does a commit.
        self.recovery_timeout = recovery_timeout(state_bytes(state.state_dict()), ft.timeout_seconds,
                                                 ft.heal_gb_per_second)
        self.commit_timeout = timeout
        transport = PGTransport(pg, timeout=self.recovery_timeout, device=device, state_dict=self._receive_into)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=state.state_dict, min_replica_size=ft.min_replica_size,
            use_async_quorum=False, timeout=self.recovery_timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds), checkpoint_transport=transport,
            rank=rank, world_size=world_size, lighthouse_addr=lighthouse, replica_id=f"titan_simple_{ft.replica_id}",
            # Every group initializes the same weights from the same seed (or loads the same checkpoint): nothing
            # to send at step 0. A group that is behind still heals from a peer.
            init_sync=False,
        )
        progress = state.progress()
        self.manager.load_state_dict({"step": progress.global_step,
                                     "batches_committed": progress.global_step * ft.group_size})
        self.failure = FailureInjection.from_environment(dump_folder, rank)
        self.hash_file = (Path(dump_folder) / f"shard_hashes_rank{rank}.jsonl") if ft.log_shard_hashes else None

    def _receive_into(self) -> dict[str, Any]:
        """Where a heal lands: this rank's own tensors, laid out as the sender's state (torchft's manager state
        around ours), so the shards arrive in place, device to device."""
        return {"user": {"default": self.state.state_dict()}, "torchft": self.manager.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        started = time.perf_counter()
        self.healed = self.state.load_state_dict(state)
        logger.warning("fault tolerance: healed from a live group: now at step %d (applied in %.2f s)",
                       self.healed.global_step, time.perf_counter() - started)

    def before_step(self, progress: Progress) -> Progress | None:
        """Join this step's quorum (before the forward); returns the progress received if this group healed."""
        step = progress.global_step
        self.failure.maybe_pause("between", step)
        self.healed = None
        self.committed_steps = step
        started = time.perf_counter()
        self._quorum()
        # A job's first quorum waits for every group: the lighthouse only waits for groups it already hears, so the
        # first group up would otherwise take a step alone (the others then heal from it). Not after a heal: a
        # restarted group joins whoever is live.
        wait_for_all = (self.first_quorum and self.healed is None) or self.failure.due("hold", step)
        self.first_quorum = False
        if wait_for_all:
            said = 0.0
            while (self.healed is None and self.manager.num_participants() < self.group_size
                   and time.perf_counter() - started < self.quorum_timeout_seconds):
                if time.perf_counter() - said > 30:  # now, then every 30 s
                    said = time.perf_counter()
                    logger.warning("fault tolerance: %d of %d replica groups have joined; waiting for the others "
                                   "(up to quorum_timeout_seconds = %.0f s)", self.manager.num_participants(),
                                   self.group_size, self.quorum_timeout_seconds)
                time.sleep(0.2)
                self._quorum()
        live = self.manager.num_participants()
        self.quorum_seconds = time.perf_counter() - started
        if live != self.live_groups:
            at = self.healed.global_step if self.healed is not None else step
            logger.warning("fault tolerance: %d of %d replica groups live (step %d, quorum took %.2f s)", live,
                           self.group_size, at + 1, self.quorum_seconds)
        self.live_groups = live
        return self.healed

    def _quorum(self) -> None:
        """torchft's quorum; a lighthouse that no longer answers is one line (``LighthouseLost``) instead of torchft's
        timeout and its traceback."""
        try:
            self.manager.start_quorum()
        except Exception as error:
            try:
                check_reachable(self.lighthouse)
            except ConfigError:
                reason = str(error).split(",")[0].split("\n")[0]
                raise LighthouseLost(
                    f"fault tolerance: the torchft lighthouse at {self.lighthouse} stopped answering ({reason}); every "
                    "replica group asks it before each step. Start it again (torchft_lighthouse --min_replicas 1 "
                    "--bind [::]:PORT) and relaunch the groups: they resume from the newest complete checkpoint."
                ) from None
            raise

    def after_backward(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> torch.Tensor:
        return self.average(params, loss_sum)

    def average(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> torch.Tensor:
        """Average this rank's gradient shards and its loss across the live groups, in place, in slices of the
        gradient buffer (``GradientBuckets``); returns the averaged loss. A failure leaves them corrupt:
        ``should_commit`` then says no."""
        started = time.perf_counter()
        pending = []
        for buffer in self.gradients.buffers([p for p in params if p.grad is not None]):
            for piece in self.gradients.slices(buffer):
                pending.append(self.manager.allreduce(piece))
                if len(pending) == 1:
                    self.failure.maybe_pause("allreduce", self.committed_steps)
        loss = loss_sum.detach().reshape(1).clone()
        pending.append(self.manager.allreduce(loss))
        for work in pending:
            work.wait()
        self.gradients.finish()
        self.allreduce_seconds = time.perf_counter() - started
        return loss.reshape(())

    def should_commit(self) -> bool:
        """Whether every rank of this group and the quorum's groups completed the step (collective in the
        group); the optimizer steps only then. A step that is not committed is retried."""
        committed = self.manager.should_commit(timeout=self.commit_timeout)
        if not committed:
            self.uncommitted_steps += 1
            logger.warning("fault tolerance: step not committed (a peer group failed: %s); retrying it",
                           self.manager.errored())
        return committed

    def step_tokens(self, tokens: int) -> int:
        """Every live group trained on as many tokens as this one."""
        return tokens * self.live_groups

    def writes_checkpoints(self) -> bool:
        """One group writes the shared checkpoints: the first in the current quorum."""
        return self.manager.participating_rank() == 0

    def after_step(self, global_step: int) -> None:
        """``log_shard_hashes``: this rank's shard digests, one line per committed step."""
        if self.hash_file is not None:
            with open(self.hash_file, "a") as f:
                f.write(json.dumps({"step": global_step, **self.state.digests()}) + "\n")

    def metrics(self) -> dict[str, float]:
        return {LIVE_GROUPS: float(self.live_groups),
                "fault_tolerance/quorum_seconds": self.quorum_seconds,
                "fault_tolerance/allreduce_seconds": self.allreduce_seconds,
                "fault_tolerance/uncommitted_steps": float(self.uncommitted_steps)}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


@dataclass
class FailureInjection:
    """``TITAN_SIMPLE_FT_FAIL`` (see above), comma-separated ``WHEN:STEP`` directives: where this group stops to be
    killed, and from which step it holds for every group (``hold``)."""

    steps: dict[str, int] = field(default_factory=dict)
    marker: Path | None = None

    @classmethod
    def from_environment(cls, dump_folder: str, rank: int) -> FailureInjection:
        setting = os.environ.get(FAILURE_ENV, "")
        steps: dict[str, int] = {}
        for directive in filter(None, setting.split(",")):
            when, _, step = directive.partition(":")
            if when not in ("between", "allreduce", "hold") or not step.isdigit():
                raise ConfigError(f"{FAILURE_ENV}={setting!r}: expected between:STEP, allreduce:STEP or hold:STEP, "
                                  "comma-separated")
            steps[when] = int(step)
        return cls(steps, Path(dump_folder) / f"failure_point.rank{rank}")

    def due(self, when: str, committed_step: int) -> bool:
        return when in self.steps and committed_step >= self.steps[when]

    def maybe_pause(self, when: str, committed_step: int) -> None:
        if not self.due(when, committed_step) or self.marker is None:
            return
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"{when}:{committed_step}\n")
        logger.warning("fault tolerance: %s=%s: waiting to be killed", FAILURE_ENV, f"{when}:{committed_step}")
        time.sleep(600)
        os._exit(1)  # nobody killed us: fail like a dead group would
