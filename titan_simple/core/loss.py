"""The training loss: summed fp32 token cross-entropy, scaled by ``1 / global tokens`` of the step.

This is the only place the loss is written. The training step calls it for a model on one rank
(``core/step.py``), the pipeline schedule on its last stage (``LossPlan.scaled`` is handed to
``build_pipeline``), validation for held-out batches, and the dry run through the step.

**Chunks** (``[training] loss_chunks``): the plain loss upcasts the whole ``[tokens, vocab]`` logits to fp32
and keeps fp32 log-probabilities for backward, then builds their fp32 gradient: at Llama 3's 128K vocabulary
and 8192 tokens that is ~4 GB per copy. ``chunked_cross_entropy_sum`` goes through the tokens a chunk at a time
and keeps only the gradient of the logits, in their own dtype.

**Deterministic mode** (``[training] deterministic``, ``torch.use_deterministic_algorithms(True)``) on CUDA, read
in torch 2.13: both losses are deterministic and raise nothing. Run on one H200 with torch 2.11 (docs/gpu_runs.md):
the chunked loss eagerly and the plain one compiled, 5 steps each, raised nothing.

* The plain loss calls ``F.cross_entropy`` on 2-D ``[tokens, vocab]`` logits, which reaches ``aten.nll_loss``
  (``tests/test_loss.py`` checks it never reaches ``nll_loss2d``). The "NLLLoss when called on a CUDA tensor" entry
  of the raising list (torch/__init__.py:1459) is ``nll_loss2d`` (4-D inputs, atomicAdd in its reduction; torch's
  own ``test_nondeterministic_alert_NLLLoss`` feeds a 4-D input and expects "nll_loss2d_forward_out_cuda_template").
  The 2-D kernels (aten/src/ATen/native/cuda/Loss.cu, read in pytorch's source) reduce in one block and write
  one gradient entry per row: no atomics, no alert. Compiled, Inductor falls back to the ATen kernels of
  scatter-like ops in deterministic mode (torch/_inductor/utils.py:3693 use_scatter_fallback, lowering.py:4688).
* The chunked loss's ``scatter_add_`` (one index per row) is on the list of ops that switch to a deterministic
  implementation (torch/__init__.py:1426), its ``gather`` runs without autograd (inside the Function's forward),
  and logsumexp / exp are plain reductions and pointwise ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from titan_simple.models.attention import AttentionInputs


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the caller divides by the global number of target tokens.

    Vocab-sharded DTensor logits (tensor parallel with loss parallel) need this call *and* the backward
    inside ``tensor_parallel.loss_parallel_context(True)``; the result is then a plain tensor, this rank's
    copy of the full loss (the same on every TP rank).
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


@dataclass(frozen=True)
class LossPlan:
    """The training loss of a run (decided by ``core/plan.py``)."""

    parallel: bool = False  # vocab-sharded logits (tensor parallel): call it under loss_parallel_context
    compiled_with_model: bool = False  # the training step compiles the model and the loss as one graph
    chunks: int = 1  # token chunks of the cross-entropy (``[training] loss_chunks``)

    def sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed fp32 cross-entropy of one microbatch."""
        return chunked_cross_entropy_sum(logits, labels, self.chunks)

    def scaled(self, logits: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """The loss one microbatch backpropagates: the summed cross-entropy x ``loss_scale`` (1 / global
        tokens). The pipeline schedule calls it on the last stage."""
        return self.sum(logits, labels) * loss_scale


class ModelWithLoss(nn.Module):
    """The model and the training loss as one module, so that ``[compile]`` traces them into one graph:
    Inductor then fuses the fp32 cross-entropy into the step and never materializes fp32 log-probabilities of
    the whole batch (``[tokens, vocab]``, ~130 MB per 16k tokens of a 2k vocabulary, ~8 GB for Llama 3 8B at
    16k tokens), nor their gradient separately from the logits' gradient."""

    def __init__(self, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager],
                 loss: LossPlan) -> None:
        super().__init__()
        self.model = model
        self._autocast = autocast
        self._loss = loss

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor,
                attention_inputs: AttentionInputs | None = None) -> torch.Tensor:
        with self._autocast():
            output = self.model(inputs, attention_inputs)
        return self._loss.sum(output, labels)


def chunked_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """``cross_entropy_sum`` computed ``chunks`` token rows at a time: never more than one chunk's fp32 logits
    (or their gradient) exists at once. Forward computes each chunk's loss and its gradient with respect to the
    logits, writes the gradient into one buffer in the logits' dtype, and keeps only that buffer: the logits
    themselves are not saved for backward, and backward scales the buffer. ``chunks = 1`` is the plain loss."""
    if chunks <= 1:
        return cross_entropy_sum(logits, labels)
    return _ChunkedCrossEntropy.apply(logits, labels, chunks)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
        if isinstance(logits, DTensor):
            total, grad = _chunks_through_autograd(logits, labels, chunks)
        else:
            total, grad = _chunks_by_hand(logits, labels, chunks)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        # Scaled in place: a second [tokens, vocab] buffer would undo half of what chunking saves. The training
        # step runs this backward once (a second backward would fail autograd's saved-tensor version check).
        (grad,) = ctx.saved_tensors
        if isinstance(grad, DTensor):  # the same scale on every rank: a replicated DTensor scalar
            mesh = grad.device_mesh
            grad_total = DTensor.from_local(grad_total, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return grad.mul_(grad_total), None, None


def _chunks_by_hand(logits: torch.Tensor, labels: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain tensors (also inside a compiled graph): d loss / d logits = softmax(logits) - one_hot(label) per
    token, zero for ignored labels (-100, as ``F.cross_entropy``)."""
    rows, labels = logits.flatten(0, -2), labels.flatten()
    grad = torch.empty_like(rows)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for x, y, g in zip(rows.chunk(chunks), labels.chunk(chunks), grad.chunk(chunks), strict=True):
        x = x.float()
        valid = y != -100
        target = torch.where(valid, y, 0).unsqueeze(1)
        lse = torch.logsumexp(x, dim=1, keepdim=True)
        total = total + ((lse - x.gather(1, target)).squeeze(1) * valid).sum()
        chunk_grad = torch.exp(x - lse).scatter_add_(1, target, torch.full_like(lse, -1.0))
        g.copy_(chunk_grad * valid.unsqueeze(1))
    return total, grad.view_as(logits)


def _chunks_through_autograd(logits: DTensor, labels: torch.Tensor, chunks: int) -> tuple[torch.Tensor, DTensor]:
    """Vocab-sharded DTensor logits (tensor parallel, under ``loss_parallel_context``): each chunk's loss and
    gradient come from the plain loss on that chunk (loss parallel's sharded log-softmax), one chunk at a time.
    Eager only: the tensor-parallel loss is never inside a compiled graph (``core/plan.py``)."""
    rows, labels = logits.flatten(0, -2), labels.flatten()
    local_grad = torch.empty_like(rows.to_local())
    total = torch.zeros((), dtype=torch.float32, device=local_grad.device)
    offset = 0
    for x, y in zip(rows.chunk(chunks), labels.chunk(chunks), strict=True):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            loss = F.cross_entropy(x.float(), y, reduction="sum")
            (chunk_grad,) = torch.autograd.grad(loss, x)
        local = chunk_grad.to_local()
        local_grad[offset:offset + local.shape[0]].copy_(local)
        offset += local.shape[0]
        total = total + (loss.to_local() if isinstance(loss, DTensor) else loss).detach()
    grad = DTensor.from_local(local_grad, rows.device_mesh, rows.placements, run_check=False,
                              shape=rows.shape, stride=rows.stride())
    return total, grad.view(logits.shape)
