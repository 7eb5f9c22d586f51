"""The training loss: summed fp32 token cross-entropy, scaled by ``1 / global tokens`` of the step.

This is the only place the loss is written. The training step calls it for a model on one rank
(``train/step.py``), the pipeline schedule on its last stage (``scaled_cross_entropy`` is handed to
``build_pipeline``), validation for held-out batches, and the dry run through the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the caller divides by the global number of target tokens.

    Vocab-sharded DTensor logits (tensor parallel with loss parallel) need this call *and* the backward
    inside ``tensor_parallel.loss_parallel_context(True)``; the result is then a plain tensor, this rank's
    copy of the full loss (the same on every TP rank).
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


def scaled_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """The loss one microbatch backpropagates: the summed cross-entropy x ``loss_scale`` (1 / global tokens)."""
    return cross_entropy_sum(logits, labels) * loss_scale


class ModelWithLoss(nn.Module):
    """The model and the training loss as one module, so that ``[compile]`` traces them into one graph:
    Inductor then fuses the fp32 cross-entropy into the step and never materializes fp32 log-probabilities of
    the whole batch (``[tokens, vocab]``, ~130 MB per 16k tokens of a 2k vocabulary, ~8 GB for Llama 3 8B at
    16k tokens), nor their gradient separately from the logits' gradient."""

    def __init__(self, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.model = model
        self._autocast = autocast

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            output = self.model(inputs)
        return cross_entropy_sum(output, labels)
