"""Validation: loss and perplexity on held-out data, every ``[validation] freq`` steps and at the last step.

    validator = Validator(plan, tokenizer=..., dp_rank=..., dp_size=..., device=..., model=..., pipeline=...)
    if validator.due(step, total_steps):
        metrics_logger.log(step, validator.validate())   # validation_metrics/loss, validation_metrics/perplexity

Every rank of the world runs every validation batch: SimpleFSDP / FSDP2 all-gather parameters inside the
forward, tensor-parallel ranks share each batch and pipeline stages pass activations along, so a rank that
skipped a forward would leave its peers waiting. Each data-parallel rank reads a disjoint part of the held-out
data (its rows of each held-out batch: the training loader's global sample index, unshuffled, on the held-out
store); ranks that share a data-parallel index (tensor / pipeline parallel) read the same batches.

The loss is the token-weighted mean over all batches of all data-parallel ranks: the summed cross-entropy and
the token count are each summed over the world, then divided. Ranks that share a batch count it equally in
both sums, so the ratio is the data-parallel mean. Perplexity is ``exp(loss)``.

Each validation starts again from the first held-out sample, so successive validations of one run see the
same batches and their losses compare directly.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from titan_simple.core.loss import cross_entropy_sum
from titan_simple.core.plan import RunPlan
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.mixture import exact_shares
from titan_simple.errors import ConfigError
from titan_simple.models.attention import AttentionInputs
from titan_simple.parallel.context_parallel import ContextParallel
from titan_simple.parallel.float8_gather import refresh_float8_weights
from titan_simple.parallel.pipeline import PipelineRun
from titan_simple.parallel.tensor_parallel import loss_parallel_context
from titan_simple.trainer.metrics import VALIDATION_LOSS, VALIDATION_PERPLEXITY, VALIDATION_SOURCES

logger = logging.getLogger(__name__)


class Validator:
    """Evaluates ``model`` (or the pipeline's stages) on this rank's share of the held-out data, with the
    trainer's loss (``core/loss.py``), autocast and loss parallel (``plan``). Give ``model`` without pipeline
    parallel, ``pipeline`` with it."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        tokenizer: Tokenizer,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        model: nn.Module | None,
        pipeline: PipelineRun | None,
        context_parallel: ContextParallel | None = None,
    ) -> None:
        validation = plan.config.validation
        if (model is None) == (pipeline is None):
            raise ValueError("Validator needs exactly one of model and pipeline")
        if plan.validation is None:
            raise ValueError("Validator: [validation] is not enabled in the plan")
        self.freq = validation.freq
        self.steps = validation.steps
        self.local_batch_size = plan.validation.local_batch_size
        self.seq_len = plan.validation.seq_len
        self.model = model
        self.pipeline = pipeline
        self.device = device
        self.loss_parallel = plan.loss.parallel
        self.autocast = plan.autocast
        self.attention = plan.attention  # block-causal validates with the training's document mask
        self.context_parallel = context_parallel  # this rank's share of each row, as in training
        # Not endless: with steps = -1 a validation reads the held-out documents once. Per source of a
        # [[validation.mixture]]: (name, share of the mixture's loss, loader); one unnamed source without.
        sources = validation.mixture or [None]
        shares = exact_shares([entry.weight for entry in validation.mixture]) if validation.mixture else [1]
        self.sources = []
        for entry, share in zip(sources, shares, strict=True):
            try:
                loader = build_dataloader(
                    dataset=entry.dataset if entry else validation.dataset,
                    dataset_path=entry.dataset_path if entry else validation.dataset_path, tokenizer=tokenizer,
                    seq_len=self.seq_len, local_batch_size=self.local_batch_size, dp_rank=dp_rank,
                    dp_world_size=dp_size, split="validation", infinite=False, cache=plan.data.cache)
            except ConfigError as error:  # the data module names the keys of [training]; these are ours
                where = "[validation]" if entry is None else f"[[validation.mixture]] '{entry.name}':"
                raise ConfigError(str(error).replace("[training]", where)) from None
            self.sources.append((entry.name if entry else None, float(share), loader))
        self.dataloader = self.sources[0][2]
        self.batches_last_run = 0

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.freq == 0 or step == total_steps

    def _model_parts(self) -> list[nn.Module]:
        return self.pipeline.model_parts if self.pipeline is not None else [self.model]

    def _batch_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, attention_inputs: AttentionInputs | None
                        ) -> torch.Tensor | None:
        """Summed cross-entropy of one local batch; None on pipeline ranks without the last stage."""
        if self.pipeline is not None:
            with self.autocast(), loss_parallel_context(self.loss_parallel):
                return self.pipeline.evaluate(inputs, labels, attention_inputs)
        with self.autocast():
            logits = self.model(inputs, attention_inputs)
        with loss_parallel_context(self.loss_parallel):
            return cross_entropy_sum(logits, labels)

    def _everyone_has_a_batch(self, has_batch: bool) -> bool:
        """Ranks may run out of held-out data at different batches: stop all when the first does."""
        if not (dist.is_available() and dist.is_initialized()):
            return has_batch
        flag = torch.tensor([1.0 if has_batch else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and perplexity over ``steps`` batches (or the whole held-out set) of every source; every rank must
        call it. With [[validation.mixture]], each source's too, and the mixture's loss is theirs weighted by the
        entries' shares. Returns the metrics keyed by their TensorBoard tags, the same values on every rank."""
        parts = self._model_parts()
        refresh_float8_weights(parts)  # float8-gathered weights' scales for the current weights (a no-op without)
        was_training = [part.training for part in parts]
        for part in parts:
            part.train(False)  # the Llama modules have no dropout; set for any model that has
        try:
            losses = {name: (share, self._loss(loader, name)) for name, share, loader in self.sources}
        finally:
            for part, training in zip(parts, was_training, strict=True):
                part.train(training)
        loss = sum(share * value for share, value in losses.values())
        metrics = {VALIDATION_LOSS: loss, VALIDATION_PERPLEXITY: math.exp(loss)}
        for name, (_, value) in losses.items():
            if name is not None:
                metrics[f"{VALIDATION_SOURCES}{name}/loss"] = value
                metrics[f"{VALIDATION_SOURCES}{name}/perplexity"] = math.exp(value)
        return metrics

    def _loss(self, loader, name: str | None) -> float:
        """The token-weighted mean loss over this validation's batches of one source's held-out data."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        batches = 0
        loader.dataset.resume_at(0)
        data = iter(loader)  # a fresh pass from the first held-out sample
        while self.steps == -1 or batches < self.steps:
            batch = next(data, None)
            if not self._everyone_has_a_batch(batch is not None):
                break
            inputs, labels = (tensor.to(self.device) for tensor in batch)
            attention_inputs = self.attention.inputs(inputs)
            if self.context_parallel is not None:
                inputs, labels, attention_inputs = self.context_parallel.shard(inputs, labels, attention_inputs)
            batch_loss = self._batch_loss_sum(inputs, labels, attention_inputs)
            if batch_loss is not None:
                loss_sum += batch_loss.detach().double()
            tokens += labels.numel()
            batches += 1
        where = "" if name is None else f" of source '{name}'"
        if batches == 0:
            raise ConfigError(
                f"[validation] no held-out batch{where}: the held-out data has fewer samples of seq_len + 1 = "
                f"{self.seq_len + 1} tokens than one validation batch (local_batch_size {self.local_batch_size} x "
                "data-parallel degree); lower [validation] local_batch_size or seq_len, or add held-out data."
            )
        if self.steps != -1 and batches < self.steps:
            logger.warning("validation: held-out data%s ran out after %d of %d batches", where, batches, self.steps)
        self.batches_last_run = batches
        if self.pipeline is not None:  # only the last stage's rank holds the loss: give it to every pp rank
            loss_sum = self.pipeline.sum_over_stages(loss_sum)
        totals = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=self.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()
