"""Train any layout a few steps through the trainer's own build and step, and compare it with one process.

    recipe = Recipe(global_batch=4)
    run = build_layout(recipe.config("--parallelism.data_parallel_shard_degree=2"), world_size=2)
    result = train_steps(run, recipe)                   # {"losses": [...], "norms": [...], ...}
    assert_parity(results, "fully_shard/eager", reference, rtol=5e-7, norm_rtol=2e-4)

``build_layout`` is ``core.plan.resolve_plan`` and ``core.assemble.build_run``: exactly what ``Trainer``
builds (autocast, loss and the step's features included), so a parity
test checks the code that trains, not a copy of it. Each step feeds one fixed global batch of random tokens (a
different one per step, from ``Recipe.batch_seed``), of which each data-parallel rank takes its rows along the
batch dim; tensor- and pipeline-parallel ranks of one dp group take the same rows. The reported loss is the
global mean (summed over the dp group, divided by the global token count): the same number on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tests.harness import one_torch_thread
from titan_simple.config import JobConfig, load_job_config
from titan_simple.core.assemble import Run, build_run
from titan_simple.core.plan import resolve_plan
from titan_simple.core.step import StepHooks

DEVICE = torch.device("cpu")

# Tolerances of parity with the single-process reference in fp32 on CPU, relative, per step (the measured
# differences are float reduction order: ~1e-7 eager, a few 1e-6 when Inductor reorders the arithmetic).
EAGER_RTOL = 1e-6
COMPILED_RTOL = 1e-5
SHARDED_NORM_RTOL = 1e-4  # gradient norms summed from dp / tp / pp shards (torch's fp32 norm kernels)


@dataclass(frozen=True)
class Recipe:
    """The model, data and optimizer settings of a parity test (fp32 everywhere)."""

    flavor: str = "debugmodel"
    seq_len: int = 64
    global_batch: int = 4  # sequences per step
    steps: int = 10
    lr: float = 3e-3
    max_norm: float = 1.0
    vocab: int = 2000
    batch_seed: int = 1234
    eos_id: int | None = None  # set: about one token in 16 becomes this id (documents for block-causal attention)
    extra: tuple[str, ...] = field(default=())  # config overrides every run of this recipe gets

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: random token ids from a generator seeded by the step."""
        g = torch.Generator().manual_seed(self.batch_seed + step)
        tokens = torch.randint(0, self.vocab, (self.global_batch, self.seq_len + 1), generator=g)
        if self.eos_id is not None:
            tokens[torch.rand(tokens.shape, generator=g) < 1 / 16] = self.eos_id
        return tokens[:, :-1], tokens[:, 1:]

    def config(self, *overrides: str) -> JobConfig:
        return load_job_config([
            f"--model.flavor={self.flavor}",
            f"--training.seq_len={self.seq_len}",
            "--training.mixed_precision_param=float32",
            "--training.mixed_precision_reduce=float32",
            f"--optimizer.lr={self.lr}",
            f"--training.max_norm={self.max_norm}",
            *self.extra,
            *overrides,
        ])


_MESHES: dict[tuple, DeviceMesh | None] = {}


def build_layout(config: JobConfig, world_size: int = 1) -> Run:
    """The trainer's assembly (``core/assemble.build_run``) of ``config``, with no LR schedule."""
    plan = resolve_plan(config, world_size, DEVICE.type)
    dims = plan.dims
    # One world mesh per layout and process, as in the trainer: DTensor may hand a parameter an equal mesh
    # object from an earlier, equal world mesh, and SimpleFSDP composes only slices of one identical root.
    key = tuple(dims.enabled_dims.items())
    if key not in _MESHES:
        _MESHES[key] = dims.build_mesh(DEVICE.type)
    mesh = _MESHES[key]
    return build_run(plan, DEVICE, mesh=mesh, lr_schedule=False)


def dp_group(layout: Run) -> dist.ProcessGroup | None:
    """The process group of this rank's data-parallel peers (the flattened ``dp`` dim for HSDP)."""
    names = [n for n in ("dp_replicate", "dp_shard") if n in layout.dims.enabled_dims]
    if not names:
        return None
    return layout.mesh["dp" if len(names) == 2 else names[0]].get_group()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """An unsharded copy (``full_tensor()`` is a collective: every rank of the mesh must call it; of a
    replicated DTensor it returns the local tensor itself, hence the clone)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _from_every_stage(layout: Run, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` of this rank's stage; under pipeline parallel those of all stages (every rank)."""
    if layout.parts.pipeline is None:
        return tensors
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensors)
    return {k: v for rank_tensors in everyone for k, v in rank_tensors.items()}


def global_loss(result, group) -> float:
    """A step's loss over the whole global batch: its loss sum summed over the data-parallel ``group``, per token."""
    loss_sum = result.loss_sum.clone()
    if group is not None:
        dist.all_reduce(loss_sum, group=group)
    return loss_sum.item() / result.global_tokens


def full_grads(layout: Run) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded; under pipeline parallel gathered from all stages (every rank)."""
    return _from_every_stage(layout, {name: full_tensor(p.grad) for part in layout.parts.modules
                                      for name, p in part.named_parameters()})


def full_weights(layout: Run) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded; under pipeline parallel gathered from all stages (every rank)."""
    return _from_every_stage(layout, {name: full_tensor(p) for part in layout.parts.modules
                                      for name, p in part.named_parameters()})


class _AfterFirstBackward(StepHooks):
    """Calls ``fn`` once, after the first step's backward and before its clipping."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.done = fn, False

    def phase(self, name: str) -> None:
        if name == "optimizer" and not self.done:
            self.done = True
            self.fn()


def train_steps(layout: Run, recipe: Recipe, steps: int | None = None, keep_grads: bool = False,
                after_first_backward: Callable[[dict], None] | None = None) -> dict:
    """Run ``steps`` (default ``recipe.steps``) training steps; return the global losses and gradient norms of
    each, and with ``keep_grads`` the unsharded gradients of the first step (before clipping, rank 0 only).
    ``after_first_backward(out)`` may add its own observations to the result. Compiled layouts also report
    Dynamo's graph breaks and unique graphs."""
    out: dict = {"losses": [], "norms": []}
    compiled = layout.plan.compile.enabled
    if compiled:  # compilation happens at the first step: count what this layout compiles
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()

    def observe() -> None:
        if keep_grads:
            grads = full_grads(layout)
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            out["grads"] = grads if rank0 or layout.parts.pipeline is not None else None
            out["grad_types"] = {type(p.grad).__name__ for p in layout.parts.parameters() if p.grad is not None}
        if after_first_backward is not None:
            after_first_backward(out)

    layout.step.hooks = _AfterFirstBackward(observe)
    group = dp_group(layout)
    rows = recipe.global_batch // layout.dp_size
    local = slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows)
    for step in range(recipe.steps if steps is None else steps):
        inputs, labels = recipe.batch(step)
        result = layout.step([(inputs[local], labels[local])])
        out["losses"].append(global_loss(result, group))
        out["norms"].append(result.grad_norm.item())
    layout.step.hooks = StepHooks()
    if compiled:
        counters = torch._dynamo.utils.counters
        out["graph_breaks"] = dict(counters["graph_break"])
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
    return out


def train_reference(recipe: Recipe, *overrides: str, keep_grads: bool = True) -> dict:
    """The single-process reference: the whole global batch on one process, one thread (as each rank of a
    2-process job has; on a busy 2-core machine two OpenMP threads made these steps 40x slower)."""
    with one_torch_thread():
        config = recipe.config(f"--training.local_batch_size={recipe.global_batch}", *overrides)
        return train_steps(build_layout(config), recipe, keep_grads=keep_grads)


# ---------------------------------------------------------------------------------------------- comparing


def max_rel_diff(values: list[float], expected: list[float]) -> float:
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected, strict=True))


def max_grad_diff(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max |grad - reference| over the largest reference entry (elementwise relative errors are meaningless
    for entries that are sums of cancelling terms)."""
    assert grads.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values())
    return max((grads[k] - expected[k]).abs().max().item() for k in expected) / scale


def assert_parity(results: list[dict], key: str, reference: dict, rtol: float, norm_rtol: float | None = None,
                  grad_rtol: float | None = None) -> None:
    """Every rank's losses (and norms) of run ``key`` match the reference's over the steps it ran; rank 0's
    first-step gradients too when kept; a compiled run compiled one graph without breaks."""
    for rank, rank_results in enumerate(results):
        run = rank_results[key]
        steps = len(run["losses"])
        losses, norms = reference["losses"][:steps], reference["norms"][:steps]
        assert max_rel_diff(run["losses"], losses) <= rtol, (key, rank, run["losses"], losses)
        assert max_rel_diff(run["norms"], norms) <= (norm_rtol or rtol), (key, rank, run["norms"], norms)
    run = results[0][key]
    if grad_rtol is not None and run.get("grads") is not None:
        assert max_grad_diff(run["grads"], reference["grads"]) <= grad_rtol, key
    if "graph_breaks" in run:
        assert run["graph_breaks"] == {}, (key, run["graph_breaks"])
