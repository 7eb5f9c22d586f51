"""Reproduce torch 2.13's failure to run a compiled step that recomputes attention over DTensor parameters, and
show that titan_simple's fix (``compile/inductor_private.prepare_compile``) makes it train (issue 30).

    python tests/repro_rng_state_after_device_mesh.py                 # with the fix: trains, same as eager
    python tests/repro_rng_state_after_device_mesh.py --without-fix   # torch as shipped: AssertionError

One process, a gloo group of one rank. Two blocks (a linear, causal ``scaled_dot_product_attention``, a linear)
whose weights are SimpleFSDP DTensors, each block under activation checkpointing that recomputes everything (our
``full`` mode), compiled with ``aot_eager``. What happens in torch:

* AOTAutograd saves, besides tensors, the parameters' ``DeviceMesh`` (an opaque object) for the backward, which
  returns DTensor gradients. The forward's outputs end: saved tensors, opaque objects, symints.
* ``scaled_dot_product_attention`` is tagged ``nondeterministic_seeded`` (even with dropout 0), so recomputing it
  makes ``torch._functorch.partitioners.functionalize_rng_ops`` save the RNG state in forward and replay it in
  backward. On a device without graph-safe RNG (CPU) it inserts each state into the forward's outputs right
  before the symints, i.e. after the opaque objects, and the backward's placeholder before the first tangent.
* The runtime slices the saved tensors by count, so the first compiled forward fails with
  ``AssertionError: expected all tensors_saved_with_vc_check to be Tensors, got types: [..., DeviceMesh, ...]``.

On CUDA the graph-safe branch adds graph inputs instead of outputs and is not affected (read in torch 2.13's
``partitioners.py``, ``apply_graphsafe_rng_functionalization``); our fix leaves graphs without such states as
they are. The upstream report text is in docs/research/upstream_rng_state_after_opaque.md.
"""

from __future__ import annotations

import argparse
import sys

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qkv(x).view(2, 4, 2, 8).transpose(1, 2)  # batch 2, 2 heads, 4 tokens, head dim 8
        attended = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 4, 16)
        return x + self.out(attended)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def loss_and_grads(compiled: bool) -> tuple[float, list[torch.Tensor]]:
    from titan_simple.parallel.activation_checkpoint import apply_checkpoint, full_recompute_policy
    from titan_simple.parallel.simple_fsdp import data_parallel

    torch.manual_seed(0)
    model = Model()
    apply_checkpoint(list(model.layers), full_recompute_policy)
    data_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), "fully_shard")
    if compiled:
        model.compile(backend="aot_eager", fullgraph=True)
    loss = model(torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)))
    loss.backward()
    return loss.item(), [p.grad.full_tensor() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without-fix", action="store_true", help="torch as shipped (the step fails)")
    args = parser.parse_args()
    if not args.without_fix:
        from titan_simple.compile.inductor_private import prepare_compile

        prepare_compile()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eager_loss, eager_grads = loss_and_grads(compiled=False)
        print(f"torch {torch.__version__}: eager loss {eager_loss:.6f}")
        try:
            loss, grads = loss_and_grads(compiled=True)
        except AssertionError as error:
            print(f"compiled: {type(error).__name__}: {str(error)[:100]}...{str(error)[-120:]}")
            sys.exit(1)
        diff = max((g - e).abs().max().item() for g, e in zip(grads, eager_grads, strict=True))
        print(f"compiled: loss {loss:.6f}, largest gradient difference from eager {diff:.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
