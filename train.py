"""Entry point: ``torchrun --nproc_per_node=2 train.py --config configs/llama3_debug.toml [--section.key value ...]``.

Also runs as plain ``python train.py ...`` (one process). ``--help`` lists every config key.
``python train.py --config llama3_70b.toml --dry_run --dry_run.world_size 256`` plans a cluster run instead
(per-rank memory, collectives, predicted tokens/s; see titan_simple/dry_run/run.py).
``python train.py --config ... --compile.precompile_world_size 8`` compiles an 8-rank job's graphs ahead into
``[compile] cache_dir`` (titan_simple/trainer/precompile.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from titan_simple.errors import NonFiniteTraining, UserError


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(  # rank 0 speaks for the job: the other ranks log errors only
        level=logging.INFO if rank == 0 else logging.ERROR,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        from titan_simple.compile.cache_folder import check_cache_variable
        from titan_simple.config import load_job_config

        config = load_job_config(argv)
        check_cache_variable()  # before torch's compiler is imported: it makes the folder at import
        if config.dry_run.enable:  # plan the run on this machine: one fake rank, meta tensors, no training
            from titan_simple.dry_run.run import run_dry_run

            run_dry_run(config)
            return 0
        if config.compile.precompile_world_size:  # compile a job's graphs ahead, from this one process
            from titan_simple.trainer.precompile import precompile

            precompile(config)
            return 0
        from titan_simple.trainer.distributed import shutdown_distributed
        from titan_simple.trainer.trainer import Trainer

        try:
            Trainer(config).train()
        except BaseException:
            shutdown_distributed(clean=False)
            raise
        shutdown_distributed()
    except UserError as error:  # ConfigError, CheckpointError: one line, no traceback
        # A config error is the same on every rank: rank 0 says it once for the job. Others (a checkpoint one
        # rank cannot write) come from the rank that saw them.
        if rank == 0 or not error.same_on_every_rank:
            print(f"error: {error}", file=sys.stderr)
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # torchrun stops the whole job when the first rank exits: give rank 0 the moment to say it.
            time.sleep(2)
        return 2
    except NonFiniteTraining as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    from titan_simple.trainer.distributed import exit_process

    exit_process(main())
