"""The chunked cross-entropy (``[training] loss_chunks``): the plain loss's values and gradients, eager and
compiled, with tensor parallel's loss parallel and on the last pipeline stage; and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_on_ranks
from tests.parity import Recipe, build_layout, max_grad_diff, max_rel_diff, train_steps
from titan_simple.core.loss import chunked_cross_entropy_sum, cross_entropy_sum

RTOL = 1e-6  # fp32: loss and gradients of the chunked loss against the plain one


def _logits_and_labels():
    torch.manual_seed(0)
    hidden = torch.randn(2, 48, 16, requires_grad=True)
    weight = torch.randn(16, 300, requires_grad=True)
    labels = torch.randint(0, 300, (2, 48))
    labels[1, 5] = -100  # ignored, as F.cross_entropy's default ignore_index
    return hidden, weight, labels


def _loss_and_grads(fn, chunks: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    hidden, weight, labels = _logits_and_labels()
    loss = fn(hidden, weight, labels, chunks)
    (loss * 0.01).backward()
    return loss.item(), hidden.grad, weight.grad


def _eager(hidden, weight, labels, chunks):
    logits = hidden @ weight
    return cross_entropy_sum(logits, labels) if chunks is None else chunked_cross_entropy_sum(logits, labels, chunks)


@pytest.mark.parametrize("chunks", [2, 3, 8, 96])
def test_chunked_loss_equals_the_plain_loss_eager(chunks):
    loss, hidden_grad, weight_grad = _loss_and_grads(_eager, chunks)
    plain, plain_hidden_grad, plain_weight_grad = _loss_and_grads(_eager, None)
    assert abs(loss - plain) / abs(plain) <= RTOL
    assert max_grad_diff({"h": hidden_grad, "w": weight_grad}, {"h": plain_hidden_grad, "w": plain_weight_grad}) <= RTOL
    assert _loss_and_grads(_eager, 1)[0] == plain  # one chunk is the plain loss


def test_chunked_loss_equals_the_plain_loss_compiled():
    torch._dynamo.reset()
    compiled = torch.compile(_eager, fullgraph=True)
    loss, hidden_grad, weight_grad = _loss_and_grads(compiled, 4)
    plain, plain_hidden_grad, plain_weight_grad = _loss_and_grads(_eager, None)
    assert abs(loss - plain) / abs(plain) <= RTOL
    assert max_grad_diff({"h": hidden_grad, "w": weight_grad}, {"h": plain_hidden_grad, "w": plain_weight_grad}) <= RTOL


def test_chunked_loss_keeps_only_the_logits_gradient_for_backward():
    """What autograd holds after the forward: the plain loss keeps the fp32 log-probabilities (and, for bf16
    logits, an fp32 copy); the chunked one keeps one buffer in the logits' dtype and frees the logits."""
    tokens, vocab = 256, 1000

    def saved_bytes(chunks: int | None) -> int:
        logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16).requires_grad_()
        labels = torch.randint(0, vocab, (1, tokens))
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            leaf = logits * 1  # a non-leaf, like a model's output
            _ = cross_entropy_sum(leaf, labels) if chunks is None else chunked_cross_entropy_sum(leaf, labels, chunks)
        return sum(t.numel() * t.element_size() for t in saved if t.numel() >= tokens * vocab // 8)

    assert saved_bytes(None) >= tokens * vocab * 4  # fp32 [tokens, vocab] log-probabilities
    assert saved_bytes(8) == tokens * vocab * 2  # the bf16 gradient buffer, nothing fp32


def _layout_losses_and_grads(rank: int, world_size: int, layouts: dict) -> dict:
    recipe = Recipe(global_batch=4, seq_len=32, steps=3)
    out = {}
    for name, overrides in layouts.items():
        torch.manual_seed(0)
        layout = build_layout(recipe.config(*overrides), world_size)
        run = train_steps(layout, recipe, keep_grads=True)
        out[name] = {"losses": run["losses"], "grads": run["grads"]}
    return out


@pytest.mark.slow
def test_chunked_loss_with_loss_parallel_and_on_the_last_pipeline_stage():
    """2 ranks: tensor parallel (vocab-sharded logits, loss parallel) and pipeline parallel (the schedule calls
    the loss on the last stage), each with the plain and the chunked loss: the same losses and gradients."""
    tp = ("--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4")
    pp = ("--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
          "--parallelism.pipeline_parallel_microbatch_size=2")
    layouts = {f"{name}/{chunks}": (*overrides, f"--training.loss_chunks={chunks}")
               for name, overrides in (("tp", tp), ("pp", pp)) for chunks in (1, 8)}
    results = run_on_ranks(_layout_losses_and_grads, 2, args=(layouts,))
    for name in ("tp", "pp"):
        plain, chunked = results[0][f"{name}/1"], results[0][f"{name}/8"]
        assert max_rel_diff(chunked["losses"], plain["losses"]) <= RTOL, name
        assert max_grad_diff(chunked["grads"], plain["grads"]) <= RTOL, name


@pytest.mark.parametrize("chunks", [None, 1, 4])
def test_deterministic_mode_gives_the_same_losses_and_gradients(chunks):
    """``[training] deterministic`` (torch.use_deterministic_algorithms): the plain and the chunked loss run and
    give what they give without it, to 1e-6 in fp32 (on CPU; the CUDA kernels are discussed in core/loss.py)."""
    expected = _loss_and_grads(_eager, chunks)
    torch.use_deterministic_algorithms(True)
    try:
        loss, hidden_grad, weight_grad = _loss_and_grads(_eager, chunks)
    finally:
        torch.use_deterministic_algorithms(False)
    assert abs(loss - expected[0]) <= RTOL * abs(expected[0])
    assert max_grad_diff({"h": hidden_grad, "w": weight_grad}, {"h": expected[1], "w": expected[2]}) <= RTOL


def test_the_plain_loss_reaches_the_2d_nll_loss_kernel():
    """Under deterministic mode on CUDA, ``nll_loss2d`` (4-D inputs) raises and the 2-D ``nll_loss`` does not:
    the plain loss must hand F.cross_entropy 2-D logits, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    hidden, weight, labels = _logits_and_labels()
    with Ops() as ops:
        cross_entropy_sum(hidden @ weight, labels).backward()
    assert {"nll_loss_forward", "nll_loss_backward"} <= ops.seen
    assert not any(name.startswith("nll_loss2d") for name in ops.seen), ops.seen
