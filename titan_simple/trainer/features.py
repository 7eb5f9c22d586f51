"""The loop's features, assembled in one place: which ones a config turns on, and where the run logs (a feature may
move it). The trainer imports from here and calls the hooks (``trainer/loop_feature.py``); it names no feature
(``tests/test_plan.py`` reads its source)."""

from __future__ import annotations

from titan_simple.config import JobConfig
from titan_simple.parallel.dims import ParallelDims
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.fault_tolerance import ReplicaGroups, check_fault_tolerance, log_folder
from titan_simple.trainer.loop_feature import LoopFeature

__all__ = ["build_loop_features", "log_folder"]


def build_loop_features(config: JobConfig, dims: ParallelDims, dist_info: DistInfo) -> list[LoopFeature]:
    """The features ``config`` turns on, in the order the trainer calls them. Before the process group exists: each
    feature's checks that need no communication run here (one line each, before anything expensive)."""
    features: list[LoopFeature] = []
    if config.fault_tolerance.enable:  # one replica group of several; its lighthouse must answer
        lighthouse = check_fault_tolerance(config, dims)
        features.append(ReplicaGroups(config, rank=dist_info.rank, world_size=dist_info.world_size,
                                      device=dist_info.device, lighthouse=lighthouse, dump_folder=log_folder(config)))
    return features
