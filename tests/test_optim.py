"""Optimizer construction (plain and DTensor parameters) and the warmup-stable-decay LR schedule."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.distributed_utils import single_rank_process_group
from titan_simple.core.optim import WarmupStableDecay, build_lr_scheduler, build_optimizer
from titan_simple.errors import ConfigError

# ------------------------------------------------------------------------------------------ schedule


def lrs_used_by_each_step(steps: int, **schedule) -> list[float]:
    """The LR of optimizer steps 1..steps, then the one left after the final scheduler step (base lr 1)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, steps=steps, **schedule)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used + [optimizer.param_groups[0]["lr"]]


def test_warmup_then_linear_decay_over_the_rest():
    # W = 3, D = 10 - 3 = 7: warmup s/4, then 1 - (s - 3)/8
    lrs = lrs_used_by_each_step(10, warmup_steps=3, decay_ratio=None, decay_type="linear")
    expected = [0.25, 0.5, 0.75, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_linear_decay_to_min_lr_factor():
    lrs = lrs_used_by_each_step(10, warmup_steps=3, decay_ratio=None, min_lr_factor=0.1)
    assert lrs[3] == pytest.approx(0.1 + 0.9 * 7 / 8)
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 1 / 8)
    assert lrs[10] == pytest.approx(0.1)


def test_cosine_decay():
    # W = 2, D = 5, progress (s - 2) / 6: 1/6, 1/3, 1/2, 2/3, 5/6
    lrs = lrs_used_by_each_step(7, warmup_steps=2, decay_ratio=None, decay_type="cosine")
    half_cos = [(1 + math.cos(math.pi * k / 6)) / 2 for k in range(1, 6)]
    assert half_cos[1:4] == pytest.approx([0.75, 0.5, 0.25])
    assert lrs == pytest.approx([1 / 3, 2 / 3, *half_cos, 0.0])
    with_floor = lrs_used_by_each_step(
        7, warmup_steps=2, decay_ratio=None, decay_type="cosine", min_lr_factor=0.2
    )
    assert with_floor[4] == pytest.approx(0.2 + 0.8 * 0.5)


def test_sqrt_decay_after_a_stable_phase():
    # W = 1, D = round(0.375 * 8) = 3 (steps 6..8, progress 1/4, 2/4, 3/4), stable steps 2..5
    lrs = lrs_used_by_each_step(8, warmup_steps=1, decay_ratio=0.375, decay_type="sqrt")
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0]
    assert lrs == pytest.approx(expected)


def test_wsd_linear():
    # W = 2, D = round(0.3 * 10) = 3: warmup 1/3, 2/3; stable steps 3..7; decay 3/4, 2/4, 1/4
    lrs = lrs_used_by_each_step(10, warmup_steps=2, decay_ratio=0.3, decay_type="linear")
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0])


def test_constant_after_warmup_ignores_decay_settings():
    lrs = lrs_used_by_each_step(6, warmup_steps=4, decay_ratio=0.9, decay_type="constant", min_lr_factor=0.5)
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])


def test_no_warmup_decays_from_the_first_step():
    lrs = lrs_used_by_each_step(3, warmup_steps=0, decay_ratio=None)
    assert lrs == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_decay_length_uses_python_rounding():
    schedule = build_lr_scheduler(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), steps=10, warmup_steps=0, decay_ratio=0.25
    ).lr_lambdas[0]
    assert schedule.decay_steps == 2  # round(2.5) == 2 (half to even)


def test_scheduler_state_round_trips_through_a_checkpoint():
    def build(steps=20, warmup_steps=5, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1):
        optimizer = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=3e-4)
        scheduler = build_lr_scheduler(
            optimizer, steps=steps, warmup_steps=warmup_steps, decay_ratio=decay_ratio,
            decay_type=decay_type, min_lr_factor=min_lr_factor,
        )
        return optimizer, scheduler

    optimizer, scheduler = build()
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["scheduler"]["lr_lambdas"][0]["decay_type"] == "cosine"

    resumed_optimizer, resumed = build(steps=99, warmup_steps=0, decay_ratio=None, decay_type="linear")
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    assert resumed.lr_lambdas[0] == scheduler.lr_lambdas[0]
    assert resumed.last_epoch == 7
    for _ in range(13):
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        for opt, sched in ((optimizer, scheduler), (resumed_optimizer, resumed)):
            opt.step()
            sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 3e-4)


def test_schedule_is_picklable():
    schedule = WarmupStableDecay(warmup_steps=2, decay_steps=3, total_steps=10, decay_type="sqrt")
    assert pickle.loads(pickle.dumps(schedule)) == schedule


@pytest.mark.parametrize(
    "schedule, message",
    [
        (dict(steps=10, warmup_steps=1, decay_ratio=1.5), "decay_ratio = 1.5 is impossible"),
        (dict(steps=10, warmup_steps=-1, decay_ratio=None), "warmup_steps = -1 is impossible"),
        (dict(steps=0, warmup_steps=0, decay_ratio=None), "[training] steps = 0 is impossible"),
        (dict(steps=10, warmup_steps=1, decay_ratio=None, decay_type="step"), "decay_type = 'step' is not"),
        (dict(steps=10, warmup_steps=1, decay_ratio=None, min_lr_factor=2.0), "min_lr_factor = 2.0 is"),
    ],
)
def test_schedule_errors_name_the_key(schedule, message):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match="^\\[") as error:
        build_lr_scheduler(optimizer, **schedule)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("steps", "warmup", "ratio", "expected_warmup", "expected_decay"), [
    (10, 11, None, 10, 0),  # the warmup alone is longer than the run
    (10, 5, 0.6, 4, 6),  # warmup + decay exceed it: the decay is kept
    (6, 5, 0.5, 3, 3),  # the debug config with --training.steps 6
    (1, 5, 0.5, 1, 0),
])
def test_short_runs_shorten_the_warmup_with_one_warning(caplog, steps, warmup, ratio, expected_warmup,
                                                        expected_decay):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING"):
        scheduler = build_lr_scheduler(optimizer, steps=steps, warmup_steps=warmup, decay_ratio=ratio)
    (schedule,) = scheduler.lr_lambdas
    assert (schedule.warmup_steps, schedule.decay_steps) == (expected_warmup, expected_decay)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"warmup shortened to {expected_warmup} steps" in warnings[0].getMessage()


# ----------------------------------------------------------------------------------------- optimizer


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 6))


def test_builds_adamw_with_decay_on_every_parameter():
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    optimizer = build_optimizer(model, lr=1e-3, eps=1e-8, weight_decay=0.1)
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert len(group["params"]) == 4  # everything trainable: norm weight/bias included, frozen embedding not
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.95) and group["foreach"] is True


@pytest.mark.parametrize(
    "implementation, expected", [("foreach", {"foreach": True}), ("for-loop", {"foreach": False}),
                                 ("fused", {"fused": True})],
)
def test_implementation_selects_the_kernel_style(implementation, expected):
    optimizer = build_optimizer(tiny_model(), name="Adam", lr=1e-3, eps=1e-8, weight_decay=0.0,
                                implementation=implementation)
    assert type(optimizer) is torch.optim.Adam
    assert {key: optimizer.param_groups[0][key] for key in expected} == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(name="SGD"), "[optimizer] name = 'SGD' is not supported; use 'AdamW' or 'Adam'."),
        (dict(implementation="cuda"), "[optimizer] implementation = 'cuda' is not supported"),
        (dict(lr=0.0), "[optimizer] lr = 0.0 is impossible"),
        (dict(eps=-1.0), "[optimizer] eps = -1.0 is impossible"),
        (dict(weight_decay=-0.1), "[optimizer] weight_decay = -0.1 is impossible"),
        (dict(betas=(0.9, 1.0)), "[optimizer] betas = (0.9, 1.0) is impossible"),
    ],
)
def test_optimizer_errors_name_the_key(overrides, message):
    kwargs = dict(lr=1e-3, eps=1e-8, weight_decay=0.1) | overrides
    with pytest.raises(ConfigError) as error:
        build_optimizer(tiny_model(), **kwargs)
    assert str(error.value).startswith(message)


@pytest.fixture
def gloo_world_of_one():
    assert not dist.is_initialized()
    with single_rank_process_group():
        yield init_device_mesh("cpu", (1,))


def shard_parameters(model: nn.Module, mesh) -> nn.Module:
    """Turn every parameter into a DTensor sharded on dim 0, the way FSDP2 stores them."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach().clone(), mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return model


@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_dtensor_parameters_step_bitwise_like_plain_tensors(gloo_world_of_one, name, implementation):
    plain, sharded = tiny_model(), shard_parameters(tiny_model(), gloo_world_of_one)
    settings = dict(name=name, lr=1e-2, eps=1e-8, weight_decay=0.1, implementation=implementation)
    plain_opt, sharded_opt = build_optimizer(plain, **settings), build_optimizer(sharded, **settings)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
            grad = torch.randn(p.shape, generator=generator)
            p.grad = grad
            q.grad = distribute_tensor(grad.clone(), gloo_world_of_one, [Shard(0)])
        plain_opt.step()
        sharded_opt.step()
    for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
        assert isinstance(q, DTensor)
        assert torch.equal(p.detach(), q.detach().full_tensor())
        assert isinstance(sharded_opt.state[q]["exp_avg"], DTensor)


def _two_rank_sharded_step(rank: int, store_path: str) -> None:
    from titan_simple.parallel.torch_private import use_one_gloo_worker_thread

    use_one_gloo_worker_thread()  # as the trainer does
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        plain, sharded = tiny_model(), shard_parameters(tiny_model(), mesh)
        settings = dict(lr=1e-2, eps=1e-8, weight_decay=0.1)
        plain_opt, sharded_opt = build_optimizer(plain, **settings), build_optimizer(sharded, **settings)
        generator = torch.Generator().manual_seed(1)  # same seed on both ranks: the same full gradients
        for _ in range(2):
            for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)], src_data_rank=None)
            plain_opt.step()
            sharded_opt.step()
        for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
            assert q.to_local().numel() < p.numel()  # really sharded, not replicated
            assert torch.equal(p.detach(), q.detach().full_tensor())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dtensor_parameters_sharded_over_two_ranks(tmp_path):
    torch.multiprocessing.start_processes(
        _two_rank_sharded_step, args=(str(tmp_path / "store"),), nprocs=2, start_method="fork"
    )
