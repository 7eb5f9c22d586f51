"""The training loop: build everything once, then ``for step: batch -> forward/backward -> clip -> step -> log ->
checkpoint``. What a feature needs from the loop (to move it before a step, the tokens a step counts, its metrics,
who writes checkpoints) comes through the hooks of ``LoopFeature`` (``trainer/loop_feature.py``), and what it
changes in a step through ``StepFeature``: this file names no feature (``tests/test_plan.py``)."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist

from titan_simple.config import JobConfig, resolve_project_path
from titan_simple.core.assemble import build_run
from titan_simple.core.device_peaks import peak_flops_per_second
from titan_simple.core.plan import RunPlan, resolve_plan
from titan_simple.core.step import StepResult
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.mixture import MixtureIndex
from titan_simple.data.staged import StagedIndex
from titan_simple.errors import NonFiniteTraining
from titan_simple.models.from_config import check_vocabulary
from titan_simple.trainer.checkpoint import CheckpointManager, TrainProgress
from titan_simple.trainer.distributed import (
    DistInfo,
    init_process_group,
    prepare_process_environment,
    read_launch_environment,
    set_timeouts,
)
from titan_simple.trainer.features import build_loop_features, log_folder
from titan_simple.trainer.loop_feature import Progress
from titan_simple.trainer.metrics import (
    DATA_SOURCES,
    MemoryMonitor,
    MetricsLogger,
    StepTimer,
    check_metrics_packages,
    global_avg_and_max,
)
from titan_simple.trainer.profiling import Profiler
from titan_simple.trainer.run_status import RunStatus
from titan_simple.trainer.validation import Validator
from titan_simple.trainer.wandb_run import wandb_options

logger = logging.getLogger("titan_simple")


def plan_and_check(config: JobConfig, world_size: int, device_type: str) -> tuple[RunPlan, Tokenizer]:
    """The run's plan and every check that needs neither communication nor a side effect (the one-line
    ConfigError of bad input): the plan's, the metrics packages' and the tokenizer's against the model's vocabulary.
    Each rank runs it first; ``titan-run`` (``trainer/launch.py``) runs it once before starting any rank."""
    plan = resolve_plan(config, world_size, device_type)
    check_metrics_packages(config)  # tensorboard, wandb: installed? (imported only when the logger is built)
    tokenizer = Tokenizer(resolve_project_path(config.model.tokenizer_path))  # fails fast on a bad path
    check_vocabulary(config, plan.model_args, tokenizer.vocab_size)
    return plan, tokenizer


class Trainer:
    """Builds everything once (the plan and its checks first, then the process group, mesh, model parts, optimizer,
    the step, data, metrics and checkpoint), then ``train()`` runs the loop. ``self.plan`` is every decision of the
    run (``core/plan.py``); ``self.run`` what it trains with (``core/assemble.Run``: the model parts, optimizer,
    schedule, the step, this rank's data-parallel index); ``self.global_step`` the optimizer steps taken. A
    caller watches the step through ``self.run.step.hooks`` (``core/step.StepHooks``)."""

    def __init__(self, config: JobConfig, dist_info: DistInfo | None = None) -> None:
        self.config = config
        self.dist = dist_info or read_launch_environment()
        self.device = self.dist.device
        self._plan_before_communication()
        self._assemble(self._start_process_groups())
        self.dataloader = self._build_dataloader()
        self._build_services()
        self._restore()

    def _describe_compiles(self) -> None:
        """After the first step, every rank (compile once gathers from all): what was compiled, loaded, reused."""
        from titan_simple.compile.cache import describe_compile_cache
        from titan_simple.compile.once import active_session, describe_compile_once

        logger.info(describe_compile_cache(self.run.parts.comm_plan_recorders))
        if self.plan.compile.once:  # a multi-rank compile: every rank joins the summary, with a session or none
            logger.info(describe_compile_once(active_session()))

    def _plan_before_communication(self) -> None:
        """Every decision and every check that needs no communication, before the process group exists."""
        config = self.config
        self.plan, self.tokenizer = plan_and_check(config, self.dist.world_size, self.device.type)
        # The loop's features (trainer/features.py), checked before anything expensive.
        self.loop_features = build_loop_features(config, self.plan.dims, self.dist)
        # Where metrics and the run status go (a feature may give each process group its own); checkpoints stay in
        # dump_folder.
        self.log_folder = log_folder(config)
        # Before CUDA starts and before the process group exists: torch reads these variables once.
        for line in [*self.plan.describe(), *prepare_process_environment(config, self.device.type)]:
            logger.info(line)
        if self.plan.compile.enabled:  # before anything compiles: torch reads the folder once
            from titan_simple.compile.cache import describe_recompile, use_compile_cache  # compiled runs only

            compile_plan = self.plan.compile
            folder = use_compile_cache(compile_plan.cache_dir)
            why = describe_recompile(folder, compile_plan.fingerprint, compile_plan.fingerprint_parts,
                                     write=self.dist.rank == 0)
            if why:
                logger.info(why)
        if config.training.deterministic:
            # Before the process group: ProcessGroupNCCL's constructor disables NCCL's non-deterministic NVLS
            # algorithms only when deterministic mode is already on (docs/parallelism.md).
            torch.use_deterministic_algorithms(True)

    def _start_process_groups(self) -> Any:
        """The process group, the seed and the mesh (returned); every group on the start-up timeout until step 1
        ends."""
        init_process_group(self.dist, self.config.comm.init_timeout_seconds)
        torch.manual_seed(self.config.training.seed)
        mesh = self.plan.dims.build_mesh(self.device.type)
        # The mesh's groups start with torch's default timeout, not the default group's: give them the start-up one.
        self.process_groups = self.plan.dims.process_groups(mesh)
        set_timeouts(self.process_groups, self.config.comm.init_timeout_seconds)
        self._start_up_timeout = True  # until the first step has ended on every rank (train())
        self._validated = False
        return mesh

    def _assemble(self, mesh: Any) -> None:
        """The run (``core/assemble.build_run``), with what the loop's features add to every step."""
        step_features = [step_feature for feature in self.loop_features for step_feature in feature.step_features()]
        self.run = build_run(self.plan, self.device, mesh=mesh, features=step_features)

    def _build_dataloader(self) -> Any:
        training, data = self.config.training, self.plan.data
        return build_dataloader(
            dataset=training.dataset, dataset_path=training.dataset_path, tokenizer=self.tokenizer,
            seq_len=training.seq_len, local_batch_size=training.local_batch_size,
            # Which rows of each global batch this rank reads (the plan's data order counts every rank that reads).
            dp_rank=data.rank(self.run.dp_rank), dp_world_size=data.ranks,
            # The layout-invariant order: global sample ids (data/sample_index.py).
            global_rows=data.global_rows, shuffle_seed=data.shuffle_seed, cache=data.cache,
            mixture=training.mixture, stages=self.plan.stages,
        )

    def _build_services(self) -> None:
        """Metrics, memory, validation, profiling, the run status and the checkpoint manager."""
        config, run = self.config, self.run
        self.metrics = MetricsLogger(
            self.log_folder, rank=self.dist.rank, enable_tensorboard=config.metrics.enable_tensorboard,
            save_tb_folder=config.metrics.save_tb_folder,
            # float8 matmuls run at twice bf16's peak; MFU counts the model's FLOPs against bf16's (plan line too)
            mfu_note=" (float8 run, of the bf16 peak)" if self.plan.float8 is not None else "",
            wandb=wandb_options(config) if config.metrics.enable_wandb else None,
        )
        self.memory = MemoryMonitor(self.device)
        self.validator = Validator(
            self.plan, tokenizer=self.tokenizer, dp_rank=run.dp_rank, dp_size=run.dp_size, device=self.device,
            model=run.parts.model, pipeline=run.parts.pipeline, context_parallel=run.parts.context_parallel,
        ) if self.plan.validation is not None else None
        self.profiler = Profiler(config.profiling, self.log_folder, rank=self.dist.rank, device=self.device)
        self.peak_flops = peak_flops_per_second(self.device)
        self.global_step = 0
        self.losses: list[float] = []  # global average loss of every step, for tests and summaries
        self._stop_signal = 0  # the first SIGINT / SIGTERM this rank received, 0 if none
        self.run_status = RunStatus(self.log_folder, rank=self.dist.rank, steps=config.training.steps)
        self._log_summary()
        self.tokens_seen = 0
        self.checkpoint = CheckpointManager(
            config, model_parts=run.parts.modules, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler,
            dataloader=self.dataloader, model_args=run.parts.model_args, dp_rank=run.dp_rank,
            dp_size=run.dp_size, device=self.device,
            special_tokens={"bos_token_id": self.tokenizer.bos_id, "eos_token_id": self.tokenizer.eos_id},
        )

    def _restore(self) -> None:
        """The newest checkpoint (model, optimizer, schedule, data position, RNG: all built by now); then the
        features start from that state."""
        resumed = self.checkpoint.load()
        if resumed is not None:
            self.global_step, self.tokens_seen = resumed.global_step, resumed.tokens_seen
        samples = self.dataloader.dataset
        if self.plan.stages is not None and samples.consumed != self.plan.stages.samples_after(self.global_step):
            # the stage table ties the data position to the step (a resume that excluded one of them)
            logger.warning("data: the stages read %s samples in %d steps; the data continues from there, not from "
                           "sample %s", f"{self.plan.stages.samples_after(self.global_step):,}", self.global_step,
                           f"{samples.consumed:,}")
            samples.resume_at(self.plan.stages.samples_after(self.global_step))
        for feature in self.loop_features:
            feature.after_restore(self.run, self._progress)

    def _log_summary(self) -> None:
        pipeline = self.run.parts.pipeline
        stages = ("" if pipeline is None else
                  " (this rank's stages: " + ", ".join(str(s.stage_index) for s in pipeline.stages) + ")")
        logger.info("built: %s parameters on %s%s | dataset %s | dump %s", f"{self.run.parts.num_params:,}",
                    self.device, stages, self._dataset_name(), self.config.job.dump_folder)

    def _dataset_name(self) -> str:
        mixture = self.config.training.mixture
        return self.config.training.dataset if not mixture else "mixture of " + ", ".join(m.name for m in mixture)

    # ------------------------------------------------------------------------------------------ step

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """One step (``self.run.step``); a non-finite gradient norm stops the run or, with
        ``skip_nonfinite_steps``, skips the update with a warning."""
        result = self.run.step(batches)
        if not result.applied and result.committed:
            self._handle_nonfinite(float(result.grad_norm))
        return result

    def _handle_nonfinite(self, grad_norm: float) -> None:
        """Skip the step (``skip_nonfinite_steps``) or stop before anything poisoned reaches a checkpoint."""
        if self.config.training.skip_nonfinite_steps:
            logger.warning("step %d: gradient norm %s is not finite; skipping this optimizer step",
                           self.global_step, grad_norm)
            return
        last_good = self.checkpoint.latest_complete()
        restart = (f"the last good checkpoint is {last_good}. Lower [optimizer] lr or raise warmup and resume from "
                   "it" if last_good else "no checkpoint was saved. Lower [optimizer] lr or raise warmup and start "
                   "again")
        raise NonFiniteTraining(
            f"step {self.global_step}: the loss or gradient norm is {grad_norm} (not finite); {restart}, or set "
            "[training] skip_nonfinite_steps = true to skip such steps."
        )

    # ------------------------------------------------------------------------------------------ loop

    def _validate(self) -> dict[str, float]:
        """One validation. The first one of a compiled run compiles the forward-only graphs (under pipeline
        parallel one stage after another, while the other stages wait): it runs under the start-up timeout, until
        the step's closing all-reduce shows every rank is done with it."""
        assert self.validator is not None
        if self.plan.compile.enabled and not self._validated:
            set_timeouts(self.process_groups, self.config.comm.init_timeout_seconds)
            self._start_up_timeout = True
        self._validated = True
        return self.validator.validate()

    def _request_stop(self, signum: int, _frame: Any) -> None:
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)
        self._stop_signal = self._stop_signal or signum

    def _stop_signal_of_any_rank(self) -> signal.Signals | None:
        """The signal a stop was requested with on any rank (the larger number if they differ), None if none:
        every rank stops after the same step, even when only some received the signal."""
        flag = torch.tensor([float(self._stop_signal)], device=self.device)
        if self.dist.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())) if flag.item() else None

    def _write_end_status(self, stop_signal: signal.Signals | None) -> None:
        """``run_status.json`` once the loop is over and every save is on disk (``trainer/run_status.py``)."""
        steps = self.config.training.steps
        checkpoint = self.checkpoint.latest_complete() if self.config.checkpoint.enable else None
        checkpoint = str(checkpoint) if checkpoint else None
        if stop_signal is not None and self.global_step < steps:
            self.run_status.write("stopped", self.global_step, signal=stop_signal.name, checkpoint=checkpoint)
        else:
            self.run_status.write("finished", self.global_step, checkpoint=checkpoint)

    def _progress(self) -> Progress:
        """Where the loop stands (what the loop's features read, and may move: ``_before_step``)."""
        return Progress(global_step=self.global_step, tokens_seen=self.tokens_seen,
                        consumed_samples=self.dataloader.dataset.consumed)

    def _read_from(self, consumed_samples: int) -> Any:
        """A data iterator whose next batch is the global batch after ``consumed_samples`` samples."""
        self.dataloader.dataset.resume_at(consumed_samples)
        return iter(self.dataloader)

    def _before_step(self, data_iter: Any) -> Any:
        """The features' turn before a step; one may move the loop (its step, tokens and data position, e.g. after
        it replaced the run's state with a peer's): the loop reads on from there."""
        for feature in self.loop_features:
            moved = feature.before_step(self._progress())
            if moved is not None:
                self.global_step, self.tokens_seen = moved.global_step, moved.tokens_seen
                data_iter = self._read_from(moved.consumed_samples)
        return data_iter

    def train(self) -> list[float]:
        """The loop, until ``[training] steps`` or a stop request on any rank; returns every step's loss."""
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpoint.save_seed()
            return []
        steps = self.config.training.steps
        previous_handlers = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        data_iter, timer, first_step = iter(self.dataloader), StepTimer(), self.global_step + 1
        self._first_step = first_step
        self.memory.reset_peak()
        self.profiler.start(first_step=self.global_step)
        self.run_status.write("running", self.global_step)
        stop_signal, failed = None, False
        try:
            while self.global_step < steps:
                data_iter = self._before_step(data_iter)
                if self.global_step >= steps:  # a feature moved the loop to its end
                    break
                consumed_before = self.dataloader.dataset.consumed
                self.global_step += 1
                with timer.data_loading():
                    batches = [next(data_iter) for _ in range(self._accumulation_steps())]
                with self.profiler.dump_on_oom(self.global_step):
                    result = self.train_step(batches)
                if not result.committed:  # a step feature voted against this step: retry it, on the same rows
                    self.global_step -= 1
                    data_iter = self._read_from(consumed_before)
                    continue
                if self.global_step == first_step and self.plan.compile.enabled:  # every graph is compiled by now
                    self._describe_compiles()
                self._record(result, timer)
                stop_signal = self._after_step(timer)
                if stop_signal is not None:
                    break
            self.checkpoint.close()  # a background save still running
        except BaseException as error:
            failed = True
            self.run_status.write_failure(self.global_step, error)
            raise
        finally:
            for s, handler in previous_handlers.items():
                signal.signal(s, handler)
            self.profiler.stop()
            self.metrics.close(failed=failed)
            for feature in self.loop_features:
                feature.shutdown()
        self._write_end_status(stop_signal)
        return self.losses

    def _record(self, result: StepResult, timer: StepTimer) -> None:
        """The step's global loss, its tokens, and (every ``log_freq`` steps) the logged metrics."""
        steps, step = self.config.training.steps, self.global_step
        # Tokens per device: ranks that split one batch (tensor / pipeline parallel) share its tokens.
        timer.step_done(result.global_tokens // self.dist.world_size)
        avg_loss, max_loss = global_avg_and_max(result.local_mean)
        self.losses.append(avg_loss)
        tokens = result.global_tokens
        for feature in self.loop_features:
            tokens = feature.step_tokens(tokens)
        self.tokens_seen += tokens
        if step == 1 or step % self.config.metrics.log_freq == 0 or step == steps:
            metrics = {
                "loss_metrics/global_avg_loss": avg_loss,
                "loss_metrics/global_max_loss": max_loss,
                "grad_norm": result.grad_norm.item(),
                "lr": result.lr,
                **timer.window_metrics(self._flops_per_token(), self.peak_flops),
                **self.memory.read(),
            }
            metrics.update(self._source_metrics())
            for feature in self.loop_features:
                metrics.update(feature.metrics())
            self.metrics.log(step, metrics, total_steps=steps, eta_seconds=timer.eta_seconds(steps - step))
            self.memory.reset_peak()

    def _accumulation_steps(self) -> int:
        """Microbatches of the step ``self.global_step``: its stage's (core/stages.py), saying when one starts."""
        stages = self.plan.stages
        if stages is None:
            return self.plan.accumulation_steps
        stage, step = stages.at_step(self.global_step), self.global_step
        if step == stage.start_step + 1 and stage.number > 0 and self.plan.compile.enabled and \
                stage.seq_len != stages.at_step(step - 1).seq_len:  # new shapes: it compiles, as the first step did
            set_timeouts(self.process_groups, self.config.comm.init_timeout_seconds)
            self._start_up_timeout = True
        if step == stage.start_step + 1 and stage.number > 0 or step == self._first_step:
            began = "starts" if step == stage.start_step + 1 else f"continues (from step {stage.start_step + 1})"
            logger.info("stage %d '%s' %s at step %d, %s tokens: global batch %d (%d accumulation), seq_len %d%s",
                        stage.number, stage.name, began, step, f"{stages.tokens_after(step - 1):,.0f}",
                        stage.global_rows, stage.accumulation_steps, stage.seq_len,
                        "; the learning rate decays from here" if stage.lr_decay else "")
        return stage.accumulation_steps

    def _flops_per_token(self) -> float:
        """The model's training FLOPs per token at this step's seq_len (TFLOP/s and MFU)."""
        flops, stages = self.run.parts.flops_per_token, self.plan.stages
        return flops if stages is None else stages.flops_per_token(self.global_step, flops, self.plan.model_args)

    def _source_metrics(self) -> dict[str, float]:
        """A mixture's (or a staged run's) tokens and epochs per source so far (data/mixture.py, data/staged.py);
        says when a source starts again."""
        samples = self.dataloader.dataset
        index = getattr(samples, "index", None)
        if not isinstance(index, MixtureIndex | StagedIndex):
            return {}
        index.say_new_epochs(samples.consumed)
        out = {}
        for name, tokens, epochs in index.progress(samples.consumed):
            out[f"{DATA_SOURCES}{name}/tokens"] = tokens
            out[f"{DATA_SOURCES}{name}/epochs"] = epochs
        return out

    def _after_step(self, timer: StepTimer) -> signal.Signals | None:
        """Profile, validate, checkpoint; returns the stop signal of any rank (after saving), else None."""
        steps, step = self.config.training.steps, self.global_step
        self.profiler.step(step)  # before validation: traces show training steps only
        if self.validator is not None and self.validator.due(step, steps):
            with timer.excluded():  # not part of the training throughput
                self.metrics.log(step, self._validate(), total_steps=steps)
        for feature in self.loop_features:
            feature.after_step(step)
        writes = all(feature.writes_checkpoints() for feature in self.loop_features)
        progress = TrainProgress(global_step=step, tokens_seen=self.tokens_seen)
        self.checkpoint.save(progress, last=step == steps, write=writes)
        stop_signal = self._stop_signal_of_any_rank()
        if self._start_up_timeout:  # every rank got past this step's all-reduce: none is still compiling
            set_timeouts(self.process_groups, self.config.comm.train_timeout_seconds)
            self._start_up_timeout = False
        if stop_signal is not None:
            self.checkpoint.save(progress, force=True, write=writes)  # nothing to do if this step saved
            logger.warning("stopped at step %d of %d on request", step, steps)
        return stop_signal
