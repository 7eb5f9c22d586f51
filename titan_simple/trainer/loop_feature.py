"""What a feature adds to the training loop (``LoopFeature``), as ``StepFeature`` (``core/step_feature.py``) does
for one step: the trainer (``trainer/trainer.py``) calls the hooks of the features the job runs with and names
none of them; ``trainer/features.py`` builds them from the config. Imports no model, parallelism or compiler, so a
feature module (fault tolerance, which scripts import too) subclasses it cheaply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_simple.core.step_feature import StepFeature

if TYPE_CHECKING:  # the assembly imports the model and the parallelisms
    from titan_simple.core.assemble import Run


@dataclass
class Progress:
    """Where the loop stands between two steps: the optimizer steps taken, the tokens trained on (every group's),
    and the data position (global samples read, ``GlobalSamples.consumed``)."""

    global_step: int
    tokens_seen: int
    consumed_samples: int


class LoopFeature:
    """What a feature adds to the loop; the defaults change nothing. The trainer calls each feature's hooks, in the
    order of its list:

        step_features()           while the run is assembled: the StepFeatures it adds to every step
        after_restore(run, progress)  once, after the checkpoint (if any) is loaded into ``run``
        before_step(progress)     before each step reads its batches; a Progress returned moves the loop there
        step_tokens(tokens)       the tokens a committed step adds to ``tokens_seen``
        metrics()                 on every logged step: extra metrics
        after_step(global_step)   after a committed step and its validation, before its checkpoint
        writes_checkpoints()      before each save: False if this rank must not write (every feature must agree)
        shutdown()                when the loop ends, by finishing, a stop request or an error
    """

    def step_features(self) -> list[StepFeature]:
        """What this feature changes inside every step (``core/assemble.build_run`` installs them)."""
        return []

    def after_restore(self, run: Run, progress: Callable[[], Progress]) -> None:
        """The run's state is where training continues from (a checkpoint's or the fresh one); ``progress()``
        says where the loop stands whenever it is called later."""

    def before_step(self, progress: Progress) -> Progress | None:
        """None to go on from ``progress``; else where the loop stands now: the loop takes its step and tokens
        and reads the next batches from its ``consumed_samples`` (ending if the step is already the last)."""
        return None

    def step_tokens(self, tokens: int) -> int:
        """The tokens a committed step counts, from ``tokens``: those this data-parallel group trained on (or what
        the feature before this one returned)."""
        return tokens

    def metrics(self) -> dict[str, float]:
        return {}

    def after_step(self, global_step: int) -> None:
        pass

    def writes_checkpoints(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass
