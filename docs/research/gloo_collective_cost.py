"""Fixed CPU cost of a gloo all-gather (issue 21): the same bytes (16 MiB gathered over 2 ranks) as 1 to 16
functional all-gathers, waited at the end, alone and with matmuls on the main thread in between.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 docs/research/gloo_collective_cost.py
"""
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    group = dist.group.WORLD
    total = 4 * 1024 * 1024  # fp32 elements gathered per step (16 MiB), about one debugmodel_large block
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for n in (1, 2, 4, 8, 16):
        shards = [torch.randn(total // n // world) for _ in range(n)]
        for mode in ("alone", "with_compute"):
            times = []
            for _ in range(12):
                dist.barrier()
                t = time.perf_counter()
                outs = [fc.all_gather_tensor(s, 0, group) for s in shards]
                if mode == "with_compute":
                    for _ in range(8):
                        a @ b
                outs = [fc.wait_tensor(o) for o in outs]
                times.append(time.perf_counter() - t)
            times = sorted(times[2:])
            if rank == 0:
                print(f"{n:3d} all-gathers {mode:13s} median {1e3 * times[len(times) // 2]:7.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
