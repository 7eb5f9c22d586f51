"""Minimal reproduction (issue 21): torch.compiler.nested_compile_region around a SimpleFSDP-style block.

SimpleFSDP gathers a weight by reading a property that calls ``DTensor.redistribute(Replicate()).to_local(
grad_placements=(Partial(),))`` on the sharded ``nn.Parameter(DTensor)``. Wrapping the block's forward in
``nested_compile_region`` puts that DTensor code inside the ``invoke_subgraph`` body. Dynamo traces it, but
AOTAutograd then runs the body with the DTensor inputs already flattened to their plain local tensors, so the
body's ``redistribute`` call (kept as a ``call_method`` by Dynamo) hits a FakeTensor:

    AttributeError: 'FakeTensor' object has no attribute 'redistribute'

Variants (each one compiled and run; the script prints OK or the error for each):
  dtensor_inside   the gather (DTensor redistribute / to_local) inside the region: SimpleFSDP as written. Fails.
  funcol_inside    a functional-collective all-gather inside the region; the second weight is read with
                   block.v.to_local() inside the region, a DTensor method: fails the same way.
  gather_outside   the gather in the outer graph, the region gets the unsharded plain weights as arguments.
  held_outside     as gather_outside, but the region stores the weights on the module (block.held) and the
                   block reads them from there, as titan_simple's property-based gather would.

Run:  python docs/research/repro/repro_nested_compile_region.py [--backend aot_eager|inductor] [--world 2]
(spawns gloo processes itself; CPU; well under 2 minutes with aot_eager). torch 2.13.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

DIM, LAYERS = 16, 4


def gather_dtensor(p):
    return p.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))


class Block(nn.Module):
    """y = x + silu(x @ W^T); W stored sharded as a DTensor (Shard(0)) like SimpleFSDP."""

    def __init__(self, mesh, variant):
        super().__init__()
        self.variant = variant
        w = torch.randn(DIM, DIM) / DIM**0.5
        self.w = nn.Parameter(distribute_tensor(w, mesh, (Shard(0),)))
        v = torch.randn(DIM, DIM) / DIM**0.5
        self.v = nn.Parameter(distribute_tensor(v, mesh, (Shard(0),)))  # same shape as w
        self.mesh = mesh
        self.held = None

    def compute(self, x, w):
        v = gather_dtensor(self.v) if self.held is None else self.held[1]
        if self.held is not None:
            w = self.held[0]
        return x + torch.nn.functional.silu(x @ w.t()) @ v.t()

    def forward(self, x):
        if self.variant == "dtensor_inside":
            return _region_dtensor(self, x)
        if self.variant == "held_outside":
            # titan_simple's experiment: gather both weights outside, hand them in as arguments, and let the
            # module read them from an attribute set inside the region (as SimpleFSDP's properties would).
            return _region_held(self, x, gather_dtensor(self.w), gather_dtensor(self.v))
        if self.variant == "funcol_inside":
            return _region_funcol(self, x, self.w.to_local())
        w = gather_dtensor(self.w)  # gather_outside: the all-gather stays in the outer graph
        return _region_compute2(self, x, w, gather_dtensor(self.v))


@torch.compiler.nested_compile_region
def _region_dtensor(block, x):
    return block.compute(x, gather_dtensor(block.w))  # compute() gathers v inside too


@torch.compiler.nested_compile_region
def _region_funcol(block, x, local_shard):
    w = funcol.all_gather_tensor(local_shard, 0, block.mesh)
    v = funcol.all_gather_tensor(block.v.to_local(), 0, block.mesh)
    return x + torch.nn.functional.silu(x @ w.t()) @ v.t()


@torch.compiler.nested_compile_region
def _region_held(block, x, w, v):
    block.held = (w, v)
    try:
        return block.compute(x, None)
    finally:
        block.held = None


@torch.compiler.nested_compile_region
def _region_compute2(block, x, w, v):
    return x + torch.nn.functional.silu(x @ w.t()) @ v.t()


class Model(nn.Module):
    def __init__(self, mesh, variant):
        super().__init__()
        self.layers = nn.ModuleList(Block(mesh, variant) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def run_variant(variant, backend, rank):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Model(mesh, variant)
    x = torch.randn(8, DIM)
    # eager reference (nested_compile_region is a no-op outside torch.compile)
    ref = model(x)
    ref.backward()
    ref_grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    try:
        loss = compiled(x)
        loss.backward()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        head = next((line for line in msg if "Error" in line), msg[0] if msg else repr(e))
        if rank == 0:
            print(f"[{variant:15s}] FAILED: {type(e).__name__}: {head}", flush=True)
            if os.environ.get("REPRO_VERBOSE"):
                traceback.print_exc()
        return
    grads = [p.grad.full_tensor() for p in model.parameters()]
    pairs = zip(grads, ref_grads, strict=True)
    ok = torch.allclose(loss, ref) and all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)
    if rank == 0:
        print(f"[{variant:15s}] OK: loss {loss.item():.6f} (eager {ref.item():.6f}), grads match eager: {ok}; "
              f"unique graphs {counters['stats']['unique_graphs']}", flush=True)


def worker(rank, world, init_file, backend, variants):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for v in variants:
            run_variant(v, backend, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--variants", default="dtensor_inside,funcol_inside,gather_outside,held_outside")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, backend {args.backend}, world {args.world}", flush=True)
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(args.world, init_file, args.backend, args.variants.split(",")), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
