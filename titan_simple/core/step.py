"""One training step: forward, loss, backward, gradient clipping and the optimizer step of one global batch.

    step = build_run(plan, device).step   # core/assemble.py builds it with the model parts and optimizer
    result = step(batches)          # batches: this rank's ``accumulation_steps`` (inputs, labels) pairs

The trainer, the parity tests, the dry run (``dry_run/``) and the scripts all run it, so what they check or
measure is what trains: the plan (``core/plan.py``) gives the step its autocast, loss mode and compile mode,
and the loss is ``core/loss.py``'s. Two implementations share the bookkeeping: ``LocalStep`` runs the model
on this rank; ``PipelineStep`` hands each batch to the pipeline schedule, which runs the loss on the last
stage.

**Loss scaling.** The loss is the fp32 cross-entropy *summed* over tokens, multiplied by
``1 / global tokens`` of the step (all microbatches, all data-parallel ranks) before backward. SimpleFSDP sums
gradients over the data-parallel ranks (``Partial("sum")``), so the result is exactly the single-process
gradient of the mean loss, whatever the layout. FSDP2 averages instead, so the scale is multiplied back by
the dp degree (``fsdp2.gradient_averaging_factor``).

**Hooks.** ``StepHooks`` lets a caller watch a step without copying it: ``begin`` / ``end`` around the whole
step (the benchmark's timer and profiler), ``phase(name)`` at "forward", "backward" and "optimizer" (the dry
run's memory tracer).

**Features.** A feature that changes what a step does (float8's weight refresh, fault tolerance's average over
replica groups) is a ``StepFeature`` the assembly (``core/assemble.py``) hands the step; this file names none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_simple.core.build import ModelParts
from titan_simple.core.plan import RunPlan
from titan_simple.core.step_feature import StepFeature
from titan_simple.models.attention import AttentionInputs
from titan_simple.parallel.clip_grad import clip_grad_norm_
from titan_simple.parallel.fsdp2 import gradient_averaging_factor
from titan_simple.parallel.tensor_parallel import loss_parallel_context

Batch = tuple[torch.Tensor, torch.Tensor]


class StepHooks:
    """Override what you need. ``phase`` is called with "forward", "backward" and "optimizer", and when SimpleFSDP
    gathers once per step also with "gather" (before the first forward) and "reduce" (after the last backward)."""

    def begin(self) -> None:
        pass

    def phase(self, name: str) -> None:
        pass

    def end(self, result: StepResult) -> None:
        pass


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss (of its data-parallel slice), detached
    local_tokens: int  # the target tokens of this rank's slice
    global_tokens: int  # the target tokens of the whole step, all dp ranks
    grad_norm: torch.Tensor  # global, before clipping; the same on every rank
    lr: float  # the learning rate this step used
    applied: bool  # False when the norm was not finite: the optimizer step was skipped
    committed: bool = True  # False: a peer replica group failed during the step (fault tolerance): retry it

    @property
    def local_mean(self) -> torch.Tensor:
        return self.loss_sum / self.local_tokens


class TrainStep:
    """Forward + loss + backward of a global batch, clipping, optimizer and schedule step. Subclasses say how
    one batch runs forward and backward (``_forward_backward``) and how the gradient norm is combined."""

    def __init__(self, parts: ModelParts, plan: RunPlan, optimizer: torch.optim.Optimizer,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *,
                 features: Sequence[StepFeature] = (), keep_grad_buffers: bool = False) -> None:
        self.parts = parts
        self.plan = plan
        self.dims = plan.dims
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        max_norm = plan.config.training.max_norm
        self.max_norm = max_norm if max_norm > 0 else float("inf")
        self.autocast = plan.autocast
        self.hooks = StepHooks()
        self.features = tuple(features)
        # Zero the gradients in place instead of freeing them: for the memory measurements, and for a feature
        # that holds the gradients' buffers.
        self.keep_grad_buffers = keep_grad_buffers or any(f.keeps_gradient_buffers for f in self.features)
        self.device = parts.device

    def loss(self, output: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """The scaled training loss of one batch's output. With loss parallel, call it and run its backward
        inside ``loss_parallel_context(plan.loss.parallel)``."""
        return self.plan.loss.scaled(output, labels, loss_scale)

    def loss_scale(self, global_tokens: int) -> float:
        return gradient_averaging_factor(self.parts.modules[0], self.dims.dp) / global_tokens

    def forward_backward(self, batches: list[Batch]) -> tuple[torch.Tensor, int]:
        """Zero the gradients, run every batch forward and backward; return this rank's summed loss
        (detached) and the global token count."""
        tokens_per_batch = batches[0][1].numel() * self.dims.dp
        global_tokens = tokens_per_batch * len(batches)
        loss_scale = self.loss_scale(global_tokens)
        self.optimizer.zero_grad(set_to_none=not self.keep_grad_buffers)
        loss_sum = torch.zeros((), device=self.device)
        for feature in self.features:
            feature.before_forward()
        gather = self.parts.once_per_step_gather
        if gather is not None:  # once per step: all-gather the weights now, reduce-scatter after the last batch
            self.hooks.phase("gather")
            pipeline = self.plan.pipeline
            gather.gather(microbatches=len(batches) * (pipeline.n_microbatches if pipeline is not None else 1))
        try:
            for inputs, labels in batches:
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                attention_inputs = self.plan.attention.inputs(inputs)  # None for causal attention
                if self.parts.context_parallel is not None:  # this rank's share of each row
                    inputs, labels, attention_inputs = self.parts.context_parallel.shard(inputs, labels,
                                                                                         attention_inputs)
                batch_loss = self._forward_backward(inputs, labels, loss_scale, attention_inputs)
                if batch_loss is not None:
                    loss_sum += batch_loss
        except BaseException:
            if gather is not None:
                gather.release()
            raise
        if gather is not None:
            self.hooks.phase("reduce")
            gather.reduce()
        loss_sum = self._combine_loss(loss_sum)
        if self.parts.context_parallel is not None:  # every cp rank: its data-parallel slice's loss
            loss_sum = self.parts.context_parallel.sum_over_ranks(loss_sum)
        return loss_sum, global_tokens

    def _params_with_gradients(self) -> list[torch.nn.Parameter]:
        return [p for part in self.parts.modules for p in part.parameters() if p.grad is not None]

    def clip_gradients(self) -> torch.Tensor:
        return clip_grad_norm_(self._params_with_gradients(), self.max_norm, pp_group=self._pp_group(), foreach=True)

    def __call__(self, batches: list[Batch]) -> StepResult:
        self.hooks.begin()
        loss_sum, global_tokens = self.forward_backward(batches)
        self.hooks.phase("optimizer")
        for feature in self.features:  # clipping sees what the features made of the gradients
            loss_sum = feature.after_backward(self._params_with_gradients(), loss_sum)
        grad_norm = self.clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses, before the schedule advances
        # The norm is global (every rank holds the same value), so all ranks take the same branch; a NaN/Inf
        # loss anywhere makes it non-finite too. The caller decides whether that stops the run.
        applied = bool(torch.isfinite(grad_norm))
        # Every feature must agree (fault tolerance: every live replica group went through the step).
        committed = all([feature.should_commit() for feature in self.features])
        if applied and committed:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.optimizer.zero_grad()
        result = StepResult(loss_sum=loss_sum, local_tokens=global_tokens // self.dims.dp,
                            global_tokens=global_tokens, grad_norm=grad_norm, lr=lr, applied=applied,
                            committed=committed)
        self.hooks.end(result)
        return result

    # -- what a layout supplies
    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float,
                          attention_inputs: AttentionInputs | None) -> torch.Tensor | None:
        raise NotImplementedError

    def _combine_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum

    def _pp_group(self):
        return None


class LocalStep(TrainStep):
    """The whole model on this rank (any data / tensor parallel layout). When the plan compiles the loss with
    the model (``plan.loss.compiled_with_model``), the build gives the model and its loss as one module
    (``parts.model_with_loss``) and the step runs that."""

    def _forward_backward(self, inputs, labels, loss_scale, attention_inputs):
        self.hooks.phase("forward")
        model_with_loss = self.parts.model_with_loss
        if model_with_loss is None:
            loss_sum = self._eager_loss(inputs, labels, attention_inputs)
        else:  # never with loss parallel (plan.choose_compile_mode)
            loss_sum = model_with_loss(inputs, labels, attention_inputs)
        with loss_parallel_context(self.plan.loss.parallel):
            self.hooks.phase("backward")
            (loss_sum * loss_scale).backward()
        return loss_sum.detach()

    def _eager_loss(self, inputs: torch.Tensor, labels: torch.Tensor, attention_inputs: AttentionInputs | None
                    ) -> torch.Tensor:
        """Forward and loss; the output (the [tokens, vocab] logits) is not referenced after this returns, so
        it lives only as long as the loss keeps it for backward (the chunked loss keeps none of it)."""
        with self.autocast():
            output = self.parts.modules[0](inputs, attention_inputs)
        with loss_parallel_context(self.plan.loss.parallel):
            return self.plan.loss.sum(output, labels)


class PipelineStep(TrainStep):
    """This rank's pipeline stages: the schedule runs forward and backward microbatch by microbatch and calls
    the training loss (``core/loss.py``, given to it by the build) on the last stage; only that stage's rank
    sees the loss, the others receive it afterwards."""

    def _forward_backward(self, inputs, labels, loss_scale, attention_inputs):
        self.hooks.phase("forward")
        with self.autocast(), loss_parallel_context(self.plan.loss.parallel):
            return self.parts.pipeline.step(inputs, labels, loss_scale, attention_inputs)

    def _combine_loss(self, loss_sum):
        return self.parts.pipeline.sum_over_stages(loss_sum)

    def _pp_group(self):
        return self.parts.pipeline.pp_group


def build_train_step(parts: ModelParts, plan: RunPlan, optimizer: torch.optim.Optimizer,
                     lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *,
                     features: Sequence[StepFeature] = (), keep_grad_buffers: bool = False) -> TrainStep:
    """The step for ``parts`` as ``plan`` says: a ``PipelineStep`` for pipeline stages, else a ``LocalStep``.
    Call ``core/assemble.build_run`` instead: it builds the parts and installs the plan's features."""
    cls = PipelineStep if parts.pipeline is not None else LocalStep
    return cls(parts, plan, optimizer, lr_scheduler, features=features, keep_grad_buffers=keep_grad_buffers)
