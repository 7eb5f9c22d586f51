"""Entry point: ``torchrun --nproc_per_node=2 train.py --config configs/llama3_debug.toml [--section.key value ...]``.

Also runs as plain ``python train.py ...`` (one process). ``--help`` lists every config key.
"""

from __future__ import annotations

import logging
import os
import sys

from titan_simple.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        from titan_simple.config import load_job_config

        config = load_job_config(argv)
        from titan_simple.train.distributed import shutdown_distributed
        from titan_simple.train.trainer import Trainer

        try:
            Trainer(config).train()
        except BaseException:
            shutdown_distributed(clean=False)
            raise
        shutdown_distributed()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
