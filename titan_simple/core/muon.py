"""Muon for the transformer blocks' matrices, AdamW for everything else: one optimizer, one learning-rate schedule.

Muon (Keller Jordan, 2024; Moonshot's "Muon is Scalable for LLM Training", 2025) keeps one momentum buffer per
matrix and replaces each update by its orthogonalization, a few Newton-Schulz iterations of the whole matrix. The
arithmetic is ``torch.optim.Muon``'s (torch 2.13), which the tests hold it to: ``buf.lerp_(grad, 1 - momentum)``;
the update is ``grad.lerp(buf, momentum)`` with Nesterov, else ``buf``; Newton-Schulz with torch's coefficients in
bfloat16 (or float32, for exactness studies); decoupled weight decay ``p *= 1 - lr * weight_decay``; then
``p -= adjusted_lr * update`` with torch's ``adjust_lr_fn`` ("original": ``sqrt(max(1, rows / cols))``;
"match_rms_adamw": ``0.2 sqrt(max(rows, cols))``, which lets AdamW's learning rate transfer). Everything else (the
embedding, the output projection, the norms) takes torch's AdamW (``torch.optim.adam.adam`` with decoupled decay),
in the second parameter group; the schedule scales both groups' rates alike.

Sharded matrices (SimpleFSDP, FSDP2, tensor parallel) are orthogonalized whole and once per step in the job: each has
one owner rank (``parallel/matrix_owners.py``: owners balanced by Newton-Schulz FLOPs), the updates' blocks go to the
owners and the results back in two all-to-alls. The momentum buffer is sharded like its weight: a rank keeps one
buffer per matrix block where AdamW keeps two.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from titan_simple.config import JobConfig
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import ModelArgs, Transformer
from titan_simple.parallel.matrix_owners import MatrixOwners

# The parameters Muon takes: every 2-D weight of a transformer block (attention q, k, v, o; the MLP's w1, w2, w3).
BLOCK_MATRIX = re.compile(r"(?:^|\.)layers\.\d+\.(?:attention\.w[qkvo]|feed_forward\.w[123])\.weight$")
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NEWTON_SCHULZ_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# torch.optim.Muon's defaults (torch/optim/_muon.py, torch 2.13): Keller Jordan's quintic coefficients.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_EPS = 1e-7


def split_parameters(named: Iterable[tuple[str, nn.Parameter]], exclude: Iterable[str] = ()
                     ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]], list[str]]:
    """``(Muon's, AdamW's, block matrices left on AdamW by exclude)``: the trainable parameters by name; a
    parameter reached under two names (tied embeddings) is taken once."""
    muon, adamw, excluded, seen = [], [], [], set()
    for name, param in named:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if BLOCK_MATRIX.search(name) and param.ndim == 2:
            if any(pattern in name for pattern in exclude):
                excluded.append(name)
                adamw.append((name, param))
            else:
                muon.append((name, param))
        else:
            adamw.append((name, param))
    return muon, adamw, excluded


@dataclass(frozen=True)
class MuonPlan:
    """Which of the model's parameters Muon takes (counted on the whole model, every stage's), for the plan's line."""

    matrices: int
    matrix_parameters: int
    others: int  # AdamW's tensors
    other_parameters: int
    excluded: tuple[str, ...]  # block matrices muon_exclude left on AdamW
    ns_steps: int
    ns_dtype: str
    adjust_lr_fn: str

    def describe(self) -> str:
        left = (f"; left on AdamW by muon_exclude: {', '.join(self.excluded[:3])}"
                f"{f' and {len(self.excluded) - 3} more' if len(self.excluded) > 3 else ''}" if self.excluded else "")
        return (f"optimizer: Muon for {self.matrices} block matrices ({self.matrix_parameters / 1e6:,.2f}M "
                f"parameters), AdamW for {self.others} others ({self.other_parameters / 1e6:,.2f}M) | Newton-Schulz "
                f"{self.ns_steps} steps in {self.ns_dtype}, lr adjusted {self.adjust_lr_fn}{left}")


def plan_optimizer(config: JobConfig, model_args: ModelArgs) -> MuonPlan | None:
    """``[optimizer] name = "Muon"``: which parameters of the whole model take it (counted on a meta model), or the
    one-line error of a model without block matrices for it; None for AdamW and Adam."""
    settings = config.optimizer
    if settings.name != "Muon":
        return None
    with torch.device("meta"):
        model = Transformer(model_args)
    muon, adamw, excluded = split_parameters(model.named_parameters(remove_duplicate=False), settings.muon_exclude)
    if not muon:
        raise ConfigError("[optimizer] name = 'Muon' but the model has no block matrix for it (attention wq / wk / wv "
                          "/ wo, feed_forward w1 / w2 / w3" + (", all in muon_exclude" if excluded else "")
                          + "); use AdamW, or drop muon_exclude patterns.")
    return MuonPlan(len(muon), sum(p.numel() for _, p in muon), len(adamw), sum(p.numel() for _, p in adamw),
                    tuple(excluded), settings.muon_ns_steps, settings.muon_ns_dtype, settings.muon_adjust_lr_fn)


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16,
                  coefficients: tuple[float, float, float] = NEWTON_SCHULZ_COEFFICIENTS,
                  eps: float = NEWTON_SCHULZ_EPS) -> torch.Tensor:
    """The orthogonalization of a whole matrix, as ``torch.optim.Muon`` computes it, in ``dtype``: scaled to
    spectral norm <= 1 (by its Frobenius norm), then ``steps`` quintic iterations on the wide orientation."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """Matmul FLOPs of ``newton_schulz`` on a matrix of ``shape``: per iteration ``X X^T``, ``G G`` and ``G X`` on
    the wide orientation (``m <= n``): ``4 m^2 n + 2 m^3``."""
    m, n = sorted(shape[:2])
    return float(steps * (4 * m * m * n + 2 * m**3))


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of (global) ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local block (an alias under no_grad: in-place changes reach the DTensor), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for ``muon`` (2-D matrices), AdamW for ``adamw``: two parameter groups (``algorithm`` says which; AdamW's
    first), whose ``lr`` a learning-rate schedule scales alike. Built on every rank of the job at once (the owners
    are agreed collectively); ``step`` is a collective too (two all-to-alls)."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[nn.Parameter], *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, foreach: bool, muon_lr: float, muon_weight_decay: float,
                 momentum: float, nesterov: bool, ns_steps: int, adjust_lr_fn: str, ns_dtype: str,
                 compile_newton_schulz: bool = False) -> None:
        groups = [  # AdamW's first: param_groups[0]["lr"] is the run's logged lr, [optimizer] lr as without Muon
            {"params": adamw, "algorithm": "adamw", "lr": lr, "weight_decay": weight_decay, "betas": betas,
             "eps": eps, "foreach": foreach},
            {"params": muon, "algorithm": "muon", "lr": muon_lr, "weight_decay": muon_weight_decay,
             "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
             "ns_dtype": ns_dtype},
        ]
        super().__init__(groups, {})
        self.owners = MatrixOwners(list(muon), [newton_schulz_flops(tuple(p.shape), ns_steps) for p in muon])
        self._newton_schulz: Callable[..., torch.Tensor] = (
            torch.compile(newton_schulz, fullgraph=True) if compile_newton_schulz else newton_schulz)
        self.newton_schulz_calls = 0  # on this rank, since it was built

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["algorithm"] == "muon" else self._adamw_step)(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        """torch's AdamW (``torch.optim.Adam`` with decoupled decay), state and arithmetic alike."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
             [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
             foreach=group["foreach"], decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _muon_step(self, group: dict) -> None:
        params = group["params"]
        updates = [self._momentum_update(p, group["momentum"], group["nesterov"]) for p in params]
        whole = self.owners.gather(updates)
        dtype = NEWTON_SCHULZ_DTYPES[group["ns_dtype"]]
        orthogonal = {i: self._newton_schulz(m, group["ns_steps"], dtype) for i, m in whole.items()}
        self.newton_schulz_calls += len(orthogonal)
        for p, update in zip(params, self.owners.scatter(orthogonal, updates, dtype), strict=True):
            local = _local(p)
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], tuple(p.shape)))

    def _momentum_update(self, param: nn.Parameter, momentum: float, nesterov: bool) -> torch.Tensor:
        """This rank's block of the matrix to orthogonalize, after the momentum buffer took the gradient."""
        if param.grad is None:
            raise RuntimeError("Muon: a block matrix got no gradient this step; every rank must orthogonalize the "
                               "same matrices (the exchange is planned for all of them)")
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
        grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if nesterov else buffer
