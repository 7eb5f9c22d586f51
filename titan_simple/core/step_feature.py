"""What a feature adds to every training step (``StepFeature``), apart from the step itself: a feature module
(fault tolerance, which the run-status and launcher scripts import too) subclasses it without importing the
model, the parallelisms and the compiler that ``core/step.py`` brings."""

from __future__ import annotations

import torch


class StepFeature:
    """What a feature adds to every step; the defaults change nothing. Called in this order: ``before_forward``
    (after the gradients are zeroed), ``after_backward`` (every gradient reduced within this group, before
    clipping: it may change the gradients and returns the loss sum to report), ``should_commit`` (False: no
    optimizer step, retry the batch)."""

    keeps_gradient_buffers = False  # True: the step zeroes gradients in place (the feature holds their buffers)

    def before_forward(self) -> None:
        pass

    def after_backward(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum

    def should_commit(self) -> bool:
        return True
