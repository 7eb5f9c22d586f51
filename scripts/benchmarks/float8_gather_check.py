"""Float8 all-gather in SimpleFSDP against gathering in the param dtype, side by side: losses and step time.

    torchrun --nproc_per_node=2 scripts/benchmarks/float8_gather_check.py                 # CPU (gloo): the debug model
    torchrun --nproc_per_node=1 scripts/benchmarks/float8_gather_check.py --dims 8b --layers 2 --seq 8192
        # one GPU (NCCL)

Builds the model the way the trainer does (float8 linears on the meta model, SimpleFSDP fully_shard on a dp mesh of
every rank, even one), then trains ``--steps`` steps on fixed random tokens with float8 all-gather off and on, eager
and compiled, and prints each run's losses and median step time. Eager losses must be bitwise equal (the script
exits 1 otherwise). On one GPU the gather is a 1-rank collective: the row shows what the float8 path costs or saves
in compute (the shard cast, torchao's matmul without its weight cast), not the halved traffic, which needs 2+ GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from titan_simple.models.float8 import convert_to_float8  # noqa: E402
from titan_simple.models.llama3 import ModelArgs, Transformer  # noqa: E402
from titan_simple.parallel.float8_gather import enable_float8_all_gather, refresh_float8_weights  # noqa: E402
from titan_simple.parallel.sharded_init import materialize_and_init  # noqa: E402
from titan_simple.parallel.simple_fsdp import MixedPrecisionPolicy, data_parallel  # noqa: E402

DIMS = {
    "debug": dict(dim=256, n_heads=16, n_kv_heads=8, vocab_size=2000, multiple_of=256),
    "8b": dict(dim=4096, n_heads=32, n_kv_heads=8, vocab_size=2000, multiple_of=1024, ffn_dim_multiplier=1.3),
}


def run(args, device: torch.device, gather_in_float8: bool, compiled: bool) -> tuple[list[float], float]:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(ModelArgs(**DIMS[args.dims], n_layers=args.layers, max_seq_len=args.seq))
    convert_to_float8(model, "tensorwise", ["output"], emulate=device.type == "cpu")
    bf16 = device.type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    data_parallel(model, mesh, mp_policy=policy)
    if gather_in_float8:
        enable_float8_all_gather(model)
    materialize_and_init(model, device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    forward = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, DIMS[args.dims]["vocab_size"], (args.batch, args.seq + 1), generator=g).to(device)
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        refresh_float8_weights([model])
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter() - start)
    return losses, statistics.median(times[2:]) if len(times) > 2 else times[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", choices=sorted(DIMS), default="debug")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels (GPU)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    if args.deterministic:  # cuBLAS and the attention backward otherwise vary from run to run on GPUs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    results = {}
    repeat = run(args, device, False, False)  # the baseline twice: how far apart two equal runs are on this device
    for compiled in (False, True):
        for gather in (False, True):
            results[(compiled, gather)] = run(args, device, gather, compiled)
            torch._dynamo.reset()
    status = 0
    if dist.get_rank() == 0:
        tokens = args.batch * args.seq * dist.get_world_size()
        print(f"| world {dist.get_world_size()} on {device.type} | compiled | all-gather | losses | ms/step "
              "| tokens/s |")
        for (compiled, gather), (losses, seconds) in results.items():
            print(f"| {args.dims} x{args.layers} seq {args.seq} | {compiled} | {'float8' if gather else 'param dtype'} "
                  f"| {' '.join(f'{x:.6f}' for x in losses)} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} |")
        eager_equal = results[(False, True)][0] == results[(False, False)][0]
        print(f"the eager baseline run twice: losses bitwise equal: {repeat[0] == results[(False, False)][0]}")
        compiled_gap = max(abs(a - b) / abs(b) for a, b in zip(results[(True, True)][0], results[(True, False)][0],
                                                                strict=True))
        print(f"eager losses bitwise equal: {eager_equal}; compiled on vs off: max relative gap {compiled_gap:.2e}")
        status = 0 if eager_equal else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
