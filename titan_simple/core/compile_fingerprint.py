"""What names a run's compiled graphs: the compile cache's folder and the fingerprint of what the graphs are
made of (the model, the layout, the recipe's settings, the loss, the shapes, torch and this package's source).
The plan computes both (``core/plan.py``); the compile cache keeps the comm plan under the fingerprint."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import torch

from titan_simple.compile.compile_plan import CPU_THREADS
from titan_simple.config import JobConfig
from titan_simple.core.loss import LossPlan
from titan_simple.models.attention import AttentionPlan
from titan_simple.models.float8 import Float8Plan
from titan_simple.models.llama3 import ModelArgs
from titan_simple.parallel.parallelize import ParallelPlan
from titan_simple.parallel.pipeline import PipelinePlan


def compile_cache_folder(config: JobConfig) -> str:
    """``[compile] cache_dir``, by default ``<dump_folder>/compile_cache`` (``compile/cache.py``)."""
    return config.compile.cache_dir or os.path.join(config.job.dump_folder, "compile_cache")


def compile_fingerprint(config: JobConfig, model_args: ModelArgs, parallel: ParallelPlan, loss: LossPlan,
                        pipeline: PipelinePlan | None, accumulation: int, float8: Float8Plan | None,
                        attention: AttentionPlan | None, device_type: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What this rank's compiled graphs are made of, hashed, and each named part's own short hash: the model,
    the layout and what the recipe applies (dtypes, checkpointing, compile settings), the loss, the shapes of a
    microbatch, the torch version and this package's source. It names the comm plan's copy in the compile cache and
    enters torch's cache keys through our pass's uuid (a graph is reused only with its plan's copy), and the parts
    say why a start compiles again (``compile/cache.describe_recompile``). On CPU the
    thread count is a part too, kept as the number: Inductor's CPU kernels are keyed by it (``CPU_THREADS``)."""
    training = config.training
    recipe = dataclasses.replace(parallel, compile=dataclasses.replace(
        parallel.compile, dump_folder=None, cache_dir="", fingerprint="", fingerprint_parts=()))
    parts = {
        # the attention only where it is not the default, so that the default's fingerprint stays as it was
        "model": repr(model_args) + repr(float8) + ("" if attention in (None, AttentionPlan()) else repr(attention)),
        "layout and recipe": repr(recipe) + repr(pipeline),
        "loss": repr(loss),
        "shapes": f"{accumulation} {training.seq_len} {training.local_batch_size} "
                  f"{config.parallelism.pipeline_parallel_microbatch_size}",
        "torch": torch.__version__,
        "titan_simple code": _package_source_hash(),
    }
    digests = {name: hashlib.sha256(text.encode()).hexdigest()[:12] for name, text in parts.items()}
    if device_type == "cpu":
        parts[CPU_THREADS] = digests[CPU_THREADS] = str(torch.get_num_threads())
    whole = hashlib.sha256("\n".join(parts.values()).encode()).hexdigest()
    return whole, tuple(digests.items())


@functools.cache
def _package_source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
