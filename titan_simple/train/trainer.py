"""The training loop: build everything once, then ``for step: batch -> forward/backward -> clip -> step -> log``."""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_simple.config import JobConfig, resolve_project_path
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.errors import ConfigError, NonFiniteTraining
from titan_simple.models.llama3 import LLAMA3_FLAVORS, build_model, count_parameters, flops_per_token
from titan_simple.parallel.dims import ParallelDims, dp_rank_and_size, validate_parallelism
from titan_simple.parallel.fsdp2 import gradient_averaging_factor
from titan_simple.parallel.parallelize import parallelize_llama, param_dtype_for, uses_loss_parallel
from titan_simple.parallel.pipeline import build_pipeline, plan_pipeline
from titan_simple.parallel.sharded_init import materialize_and_init
from titan_simple.parallel.simple_fsdp import clip_grad_norm_
from titan_simple.parallel.tensor_parallel import loss_parallel_context
from titan_simple.train.checkpoint import CheckpointManager, TrainProgress
from titan_simple.train.distributed import DistInfo, init_process_group, read_launch_environment
from titan_simple.train.metrics import (
    MemoryMonitor,
    MetricsLogger,
    StepTimer,
    global_avg_and_max,
    peak_flops_per_second,
)
from titan_simple.train.optim import build_lr_scheduler, build_optimizer
from titan_simple.train.profiling import Profiler
from titan_simple.train.validation import Validator

logger = logging.getLogger("titan_simple")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the caller divides by the global number of target tokens.

    Vocab-sharded DTensor logits (tensor parallel with loss parallel) need this call *and* the backward
    inside ``tensor_parallel.loss_parallel_context(True)``; the result is then a plain tensor, this rank's
    copy of the full loss (the same on every TP rank).
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


class Trainer:
    def __init__(self, config: JobConfig, dist_info: DistInfo | None = None) -> None:
        self.config = config
        t = config.training
        self.dist = dist_info or read_launch_environment()
        self.device = self.dist.device
        p = config.parallelism
        self.dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=self.dist.world_size,
        )
        self.gradient_accumulation_steps = self._accumulation_steps()
        if config.model.flavor in LLAMA3_FLAVORS:  # an unknown flavor is reported by build_model
            validate_parallelism(self.dims, LLAMA3_FLAVORS[config.model.flavor], config)
            if self.dims.pp > 1:
                self.pp_plan = plan_pipeline(config, LLAMA3_FLAVORS[config.model.flavor].n_layers, self.dims.pp)
        self.loss_parallel = uses_loss_parallel(self.dims, config)
        self.tokenizer = Tokenizer(resolve_project_path(config.model.tokenizer_path))  # fails fast on a bad path
        init_process_group(self.dist)  # only now: every check above needs no communication
        torch.manual_seed(t.seed)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_size = dp_rank_and_size(self.mesh, self.dims)

        self.dataloader = build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_size,
        )

        self.model_args, model = self._build_model()
        self.num_params = count_parameters(model)
        self.flops_per_token = flops_per_token(
            self.model_args, count_parameters(model, exclude_embedding=True), t.seq_len
        )
        self.param_dtype = param_dtype_for(config, self.device)
        if self.dims.pp > 1:
            # This rank's stages, each split off, parallelized and initialized like a whole model, and the
            # schedule that runs them. self.model stays None: every stage is in self.model_parts.
            self.model = None
            self.pipeline = build_pipeline(
                model, self.dims, self.mesh, config, self.device, self.pp_plan, cross_entropy_sum
            )
            self.model_parts = self.pipeline.model_parts
        else:
            self.pipeline = None
            self.model = parallelize_llama(model, self.dims, self.mesh, config, self.device)
            materialize_and_init(self.model, self.device, t.seed)  # the same values on every layout
            self.model_parts = [self.model]

        o, s = config.optimizer, config.lr_scheduler
        self.optimizer = build_optimizer(
            nn.ModuleList(self.model_parts), name=o.name, lr=o.lr, eps=o.eps, weight_decay=o.weight_decay,
            implementation=o.implementation,
        )
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, steps=t.steps, warmup_steps=s.warmup_steps, decay_ratio=s.decay_ratio,
            decay_type=s.decay_type, min_lr_factor=s.min_lr_factor,
        )
        self.metrics = MetricsLogger(
            config.job.dump_folder, rank=self.dist.rank, enable_tensorboard=config.metrics.enable_tensorboard,
            save_tb_folder=config.metrics.save_tb_folder,
        )
        self.memory = MemoryMonitor(self.device)
        self.validator = Validator(
            config, tokenizer=self.tokenizer, dp_rank=self.dp_rank, dp_size=self.dp_size, device=self.device,
            model=self.model, pipeline=self.pipeline, loss_sum_fn=cross_entropy_sum, loss_parallel=self.loss_parallel,
            autocast=self._autocast,
        ) if config.validation.enable else None
        self.profiler = Profiler(config.profiling, config.job.dump_folder, rank=self.dist.rank, device=self.device)
        self.peak_flops = peak_flops_per_second(self.device)
        self.step = 0
        self.losses: list[float] = []  # global average loss of every step, for tests and summaries
        self._stop_requested = False
        self._log_summary()
        self.tokens_seen = 0
        self.checkpoint = CheckpointManager(
            config, model_parts=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, model_args=self.model_args, dp_rank=self.dp_rank, dp_size=self.dp_size,
            device=self.device,
        )
        resumed = self.checkpoint.load()  # model, optimizer, schedule, data position, RNG: all built by now
        if resumed is not None:
            self.step, self.tokens_seen = resumed.step, resumed.tokens_seen

    # ------------------------------------------------------------------------------------------ build

    def _accumulation_steps(self) -> int:
        t = self.config.training
        per_step = t.local_batch_size * self.dims.dp
        if t.global_batch_size == -1:
            return 1
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"[training] global_batch_size = {t.global_batch_size} is not a multiple of local_batch_size "
                f"x data-parallel degree = {t.local_batch_size} x {self.dims.dp} = {per_step}; "
                f"choose a multiple of {per_step} or -1."
            )
        return t.global_batch_size // per_step

    def _build_model(self):
        t, m = self.config.training, self.config.model
        model = build_model(m.flavor, max_seq_len=t.seq_len, device="meta")
        if self.tokenizer.vocab_size > model.args.vocab_size:
            raise ConfigError(
                f"[model] tokenizer_path {m.tokenizer_path} has {self.tokenizer.vocab_size} tokens but flavor "
                f"'{m.flavor}' has a vocabulary of {model.args.vocab_size}; use a matching tokenizer or flavor."
            )
        return model.args, model

    def _log_summary(self) -> None:
        t, p = self.config.training, self.config.parallelism
        tokens = t.local_batch_size * self.dims.dp * self.gradient_accumulation_steps * t.seq_len
        logger.info(
            "model llama3 %s: %s parameters | mesh %s (world %d, %s %s) | %s on %s | "
            "global batch %d tokens (%d accumulation steps) | dataset %s | dump %s",
            self.config.model.flavor, f"{self.num_params:,}", self.dims.describe, self.dist.world_size,
            p.fsdp_implementation, self.dims.data_parallel_mode if self.dims.dp_enabled else "no data parallel",
            str(self.param_dtype).removeprefix("torch."), self.device, tokens, self.gradient_accumulation_steps,
            t.dataset, self.config.job.dump_folder,
        )
        if self.pipeline is not None:
            logger.info(self.pipeline.describe())

    # ------------------------------------------------------------------------------------------ step

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Without data parallel nobody casts the weights for us: autocast does it (GPU bf16 only)."""
        if self.dims.dp_enabled or self.param_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.param_dtype)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        t = self.config.training
        global_tokens = t.local_batch_size * t.seq_len * self.dims.dp * len(batches)
        loss_scale = gradient_averaging_factor(self.model_parts[0], self.dims.dp) / global_tokens
        self.optimizer.zero_grad()
        local_loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            if self.pipeline is not None:  # forward and backward through all stages, microbatch by microbatch
                with self._autocast(), loss_parallel_context(self.loss_parallel):
                    loss_sum = self.pipeline.step(inputs, labels, loss_scale)
                if loss_sum is not None:  # only the rank with the last stage sees the loss
                    local_loss_sum += loss_sum
                continue
            with self._autocast():
                logits = self.model(inputs)
            with loss_parallel_context(self.loss_parallel):
                loss_sum = cross_entropy_sum(logits, labels)
                (loss_sum * loss_scale).backward()
            local_loss_sum += loss_sum.detach()
        if self.pipeline is not None:
            local_loss_sum = self.pipeline.sum_over_stages(local_loss_sum)
        grad_norm = self._clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses, before the schedule advances
        # The norm is global (every rank holds the same value), so all ranks take the same branch; a NaN/Inf
        # loss anywhere makes it non-finite too.
        if not torch.isfinite(grad_norm):
            self._handle_nonfinite(float(grad_norm))
        else:
            self.optimizer.step()
            self.lr_scheduler.step()
        local_tokens = global_tokens // self.dims.dp
        return {"local_mean": local_loss_sum / local_tokens, "global_tokens": global_tokens,
                "grad_norm": grad_norm, "lr": lr}

    def _handle_nonfinite(self, grad_norm: float) -> None:
        """Skip the step (``skip_nonfinite_steps``) or stop before anything poisoned reaches a checkpoint."""
        if self.config.training.skip_nonfinite_steps:
            logger.warning("step %d: gradient norm %s is not finite; skipping this optimizer step",
                           self.step, grad_norm)
            self.optimizer.zero_grad()
            return
        last_good = self.checkpoint.latest_complete()
        where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved"
        raise NonFiniteTraining(
            f"step {self.step}: the loss or gradient norm is {grad_norm} (not finite); {where}. Lower "
            "[optimizer] lr or raise warmup, resume from that checkpoint, or set [training] "
            "skip_nonfinite_steps = true to skip such steps."
        )

    def _clip_gradients(self) -> torch.Tensor:
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        max_norm = self.config.training.max_norm
        max_norm = max_norm if max_norm > 0 else float("inf")
        if self.pipeline is not None:  # one norm over all stages: the pp ranks combine theirs
            return self.pipeline.clip_grad_norm_(params, max_norm)
        return clip_grad_norm_(params, max_norm, foreach=True)

    # ------------------------------------------------------------------------------------------ loop

    def _request_stop(self, signum: int, _frame: Any) -> None:
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)
        self._stop_requested = True

    def _everyone_agrees_to_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_requested else 0.0], device=self.device)
        if self.dist.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _progress(self) -> TrainProgress:
        return TrainProgress(step=self.step, tokens_seen=self.tokens_seen)

    def train(self) -> list[float]:
        t, log_freq = self.config.training, self.config.metrics.log_freq
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpoint.save_seed()
            return []
        previous_handlers = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        data_iter = iter(self.dataloader)
        timer = StepTimer()
        self.memory.reset_peak()
        self.profiler.start(first_step=self.step)
        try:
            while self.step < t.steps:
                self.step += 1
                with timer.data_loading():
                    batches = [next(data_iter) for _ in range(self.gradient_accumulation_steps)]
                with self.profiler.dump_on_oom(self.step):
                    result = self.train_step(batches)
                # Tokens per device: ranks that split one batch (tensor / pipeline parallel) share its tokens.
                timer.step_done(result["global_tokens"] // self.dist.world_size)
                avg_loss, max_loss = global_avg_and_max(result["local_mean"])
                self.losses.append(avg_loss)
                self.tokens_seen += result["global_tokens"]
                if self.step == 1 or self.step % log_freq == 0 or self.step == t.steps:
                    metrics = {
                        "loss_metrics/global_avg_loss": avg_loss,
                        "loss_metrics/global_max_loss": max_loss,
                        "grad_norm": result["grad_norm"].item(),
                        "lr": result["lr"],
                        **timer.window_metrics(self.flops_per_token, self.peak_flops),
                        **self.memory.read(),
                    }
                    self.metrics.log(self.step, metrics, total_steps=t.steps,
                                     eta_seconds=timer.eta_seconds(t.steps))
                    self.memory.reset_peak()
                self.profiler.step(self.step)  # before validation: traces show training steps only
                if self.validator is not None and self.validator.due(self.step, t.steps):
                    with timer.excluded():  # not part of the training throughput
                        self.metrics.log(self.step, self.validator.validate(), total_steps=t.steps)
                self.checkpoint.save(self._progress(), last=self.step == t.steps)
                if self._everyone_agrees_to_stop():
                    self.checkpoint.save(self._progress(), force=True)  # nothing to do if this step just saved
                    logger.warning("stopped at step %d of %d on request", self.step, t.steps)
                    break
            self.checkpoint.close()  # a background save still running
        finally:
            for s, handler in previous_handlers.items():
                signal.signal(s, handler)
            self.profiler.stop()
            self.metrics.close()
        return self.losses
