"""Float8 linears (issue 31, part 1): the config, which linears convert, the one-line refusals, and training on CPU.

On CPU torchao's emulation runs (``models/float8.py``): every cast to float8 is real, the matmul runs in fp32 on the
dequantized values. So the numbers here are float8's numbers (a few e-4 away from fp32 after 3 steps), and equal
layouts must agree as closely as they do in fp32: the casts are elementwise given the scale, and tensorwise's scale
is the amax of the whole (gathered) weight, the same on every layout.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from tests.distributed_utils import run_worlds_side_by_side
from tests.harness import FP32, ONE_ROW, output_of, train_py
from tests.parity import Recipe, build_layout, max_rel_diff, train_reference, train_steps
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.models import float8 as float8_module
from titan_simple.models.float8 import Float8Targets, convert_to_float8, float8_problem, float8_targets
from titan_simple.models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer, TransformerBlock
from titan_simple.models.rope import precompute_freqs_cis
from titan_simple.parallel.activation_checkpoint import (
    FLOAT8_AMAX_OPS,
    SelectiveOpPolicy,
    apply_checkpoint,
    is_float8_scaling,
)
from titan_simple.parallel.tensor_parallel import local_linear_shape

pytest.importorskip("torchao.float8")

RECIPE = Recipe(steps=3, extra=("--model.n_layers=2",))
FLOAT8 = ("--model.converters=float8",)
# Largest relative loss differences over 3 steps, measured (2 blocks, fp32 CPU, 2026-11-26; -s prints them):
# * float8 against fp32: tensorwise 4.8e-5, rowwise 1.6e-5. A run that converted nothing gives 0: the lower bound.
FP32_GAP = (1e-7, 2e-3)
# * compiled against eager (tensorwise 2.2e-6, rowwise 3.7e-6): Inductor computes the amax and the scale in another
#   order; an element at a float8 rounding boundary then rounds the other way (one float8 step, 2^-3 relative).
COMPILED_RTOL = 1e-5
# * fully_shard on 2 ranks against 1 process. Rowwise (1.7e-6): each row's scale is its own, whatever the batch
#   split: fp32 reduction order only. Tensorwise (1.6e-5): each rank scales its activations by its own half-batch's
#   amax, so every activation rounds to float8 differently: a difference of the order of float8's own gap to fp32
#   (4.8e-5), which is as close as dynamic tensorwise scaling can be across layouts (TorchTitan's too).
SHARDED_RTOL = {"rowwise": 5e-6, "tensorwise": 1e-4}
NORM_RTOL = 2e-4  # sharded fp32 norms alone differ by 4.3e-5 (tests/test_simple_fsdp_llama.py); measured 9.3e-5


def test_converters_and_float8_section_parse():
    config = load_job_config(["--model.converters", "float8", "--float8.recipe", "rowwise",
                              "--float8.filter_fqns", "output,layers.0.attention"])
    assert config.model.converters == ["float8"] and config.float8.recipe == "rowwise"
    assert config.float8.filter_fqns == ["output", "layers.0.attention"]
    assert load_job_config([]).float8.filter_fqns == ["output"]
    with pytest.raises(ConfigError, match=r"\[model\] converters = \['fp8'\] is impossible"):
        load_job_config(["--model.converters", "fp8"])
    with pytest.raises(ConfigError, match="choose one of tensorwise, rowwise, rowwise_with_gw_hp"):
        load_job_config(["--float8.recipe", "delayed"])


def test_targets_skip_the_filtered_and_the_misaligned():
    model = nn.ModuleDict({"a": nn.Linear(32, 64), "b": nn.Linear(20, 32), "output": nn.Linear(64, 48)})
    assert float8_targets(model, ["output"]) == Float8Targets(converted=("a",), filtered=("output",),
                                                              misaligned=("b",))
    assert float8_targets(model, []).describe("rowwise") == (
        "float8 rowwise: 2 linears, 1 with dims not multiples of 16 kept in high precision")


def test_targets_check_each_ranks_tensor_parallel_shard():
    """A float8 matmul needs its dims aligned on the rank that runs it: a SwiGLU width of 48 is aligned whole and
    24 wide on each of 2 TP ranks (w1 / w3 split their outputs, w2 its inputs), so those stay in high precision."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_size=48)
    with torch.device("meta"):
        model = Transformer(args)
    assert float8_targets(model, ["output"]).misaligned == ()
    sharded = float8_targets(model, ["output"], local_linear_shape(2))
    assert sharded.misaligned == tuple(f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3"))
    assert sharded.converted == tuple(f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo"))
    assert local_linear_shape(4)("layers.3.attention.wo", 64, 32) == (16, 32)  # row-parallel: inputs split
    assert local_linear_shape(4)("output", 64, 32) == (64, 8)  # column-parallel: outputs split


def test_rowwise_compiles_with_precision_cast_emulation():
    """Rowwise rounds its scales to powers of two, so a compiled recomputation must round through each cast as eager
    does (TorchTitan turns Inductor's emulate_precision_casts on for rowwise; pytorch#150859)."""
    for recipe, emulated in (("tensorwise", False), ("rowwise", True), ("rowwise_with_gw_hp", True)):
        plan = resolve_plan(RECIPE.config(*FLOAT8, f"--float8.recipe={recipe}", "--compile.enable"), 1, "cpu")
        assert plan.compile.inductor_options().get("emulate_precision_casts", False) is emulated, recipe
    off = resolve_plan(RECIPE.config(*FLOAT8, "--float8.recipe=rowwise", "--compile.enable",
                                     "--float8.stable_recompute=false"), 1, "cpu")
    assert "emulate_precision_casts" not in off.compile.inductor_options() and not off.parallel.save_float8_amax
    assert hasattr(torch._inductor.config, "emulate_precision_casts")  # torch.compile refuses unknown options


class _MulRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.muls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mul.Tensor:
            self.muls.append((args, out))
        return out


def test_reshard_policy_recomputes_rowwise_weight_scaling_and_nothing_of_the_model():
    """``weight * scale`` of a rowwise float8 linear (a [rows, 1] / [1, cols] fp32 scale) is what SimpleFSDP's
    reshard policy recomputes with the gather: saved, it is an fp32 copy of the unsharded weight (measured in the dry
    run of the debug model on 2 ranks, AC none: 18.9 MB, the block weights in fp32, no longer kept). The model's own
    broadcast multiplies (RMSNorm, RoPE, SwiGLU) are not float8 scaling."""
    args = LLAMA3_FLAVORS["debugmodel"]
    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    convert_to_float8(block, "rowwise", [], emulate=True)
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    recorder = _MulRecorder()
    with recorder:
        block(x, precompute_freqs_cis(args.head_dim, 16, args.rope_theta))
    weights = {shape for p in block.parameters() if p.dim() == 2 for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
    scaled_weights = [(a, out) for a, out in recorder.muls
                      if tuple(out.shape) in weights and out.dtype == torch.float32]
    assert len(scaled_weights) == 7  # every linear's weight, once per forward
    assert all(is_float8_scaling(torch.ops.aten.mul.Tensor, a) for a, _ in scaled_weights)
    plain = TransformerBlock(0, args)
    recorder = _MulRecorder()
    with recorder:
        plain(x, precompute_freqs_cis(args.head_dim, 16, args.rope_theta))
    assert recorder.muls and not any(is_float8_scaling(torch.ops.aten.mul.Tensor, a) for a, _ in recorder.muls)


def test_op_policy_saves_float8_amaxes():
    """The amax behind every scale (tensorwise ``max``, rowwise ``amax`` per row / column) is saved: a recomputed
    cast reuses the forward's scale, as TorchTitan saves ``aten.max``."""
    decisions = []

    class Recording(SelectiveOpPolicy):
        def __init__(self, every_second_matmul: bool) -> None:
            super().__init__(every_second_matmul)
            self.cache_key += " (recording amaxes)"  # a policy of its own in the checkpoint's registry

        def fresh(self):
            return Recording(self.every_second_matmul)

        def __call__(self, ctx, op, *a, **k):
            decision = super().__call__(ctx, op, *a, **k)
            if op in FLOAT8_AMAX_OPS:
                decisions.append((op, decision))
            return decision

    args = LLAMA3_FLAVORS["debugmodel"]
    for recipe, op in (("tensorwise", torch.ops.aten.max.default), ("rowwise", torch.ops.aten.amax.default)):
        decisions.clear()
        torch.manual_seed(0)
        block = TransformerBlock(0, args)
        convert_to_float8(block, recipe, [], emulate=True)
        apply_checkpoint(block, Recording(every_second_matmul=True))
        x = torch.randn(2, 16, args.dim, requires_grad=True)
        block(x, precompute_freqs_cis(args.head_dim, 16, args.rope_theta)).sum().backward()
        assert len(decisions) >= 14 and {d for _, d in decisions} == {CheckpointPolicy.MUST_SAVE}, recipe
        assert {o for o, _ in decisions} == {op}, recipe


def test_float8_settings_without_the_converter_are_named_in_the_plan():
    plan = resolve_plan(RECIPE.config("--float8.recipe=rowwise", "--float8.all_gather=false"), 1, "cpu")
    assert plan.float8 is None
    assert "float8.all_gather, float8.recipe ignored: [model] converters has no float8" in "\n".join(plan.describe())
    assert "ignored" not in "\n".join(resolve_plan(RECIPE.config(), 1, "cpu").describe())


def test_the_plan_counts_the_debug_models_linears():
    plan = resolve_plan(RECIPE.config(*FLOAT8), 1, "cpu")
    assert plan.float8.targets.converted == tuple(
        f"layers.{i}.{name}" for i in range(2) for name in (
            "attention.wq", "attention.wk", "attention.wv", "attention.wo",
            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
    assert plan.float8.targets.filtered == ("output",) and plan.float8.emulate
    assert "float8 tensorwise: 14 linears, 1 by filter_fqns kept in high precision" in "\n".join(plan.describe())
    assert resolve_plan(RECIPE.config(), 1, "cpu").float8 is None
    on_gpu = dataclasses.replace(plan.float8, emulate=False)
    assert on_gpu.describe().endswith("kept in high precision; mfu is against the bf16 peak")


def test_a_float8_model_has_the_same_state_dict_as_a_bf16_one():
    """Checkpoints stay in the parameters' dtype: a float8 run's checkpoint loads without float8 and the reverse
    (the same names, shapes and dtypes; Float8Linear keeps nn.Linear's weight and adds no buffer)."""
    from torchao.float8.float8_linear import Float8Linear

    def layout_state(*overrides: str) -> tuple[dict[str, tuple], int]:
        model = build_layout(RECIPE.config(f"--training.local_batch_size={RECIPE.global_batch}", *overrides)
                             ).parts.as_module()
        float8_linears = sum(isinstance(m, Float8Linear) for m in model.modules())
        return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}, float8_linears

    (plain, none), (converted, swapped) = layout_state(), layout_state(*FLOAT8)
    assert (none, swapped) == (0, 14)
    assert converted == plain and len(plain) == 21


def test_torchaos_float8_op_table_is_where_float8_gloo_wraps_it():
    """``parallel/float8_gloo.py`` wraps one entry of torchao's private op table; if torchao moves it, fail here."""
    import torch  # noqa: PLC0415
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE  # noqa: PLC0415

    from titan_simple.parallel.float8_gloo import gather_float8_as_bytes  # noqa: PLC0415

    op = torch.ops._c10d_functional.all_gather_into_tensor.default
    assert op in FLOAT8_OPS_TABLE and torch.ops._c10d_functional.wait_tensor.default in FLOAT8_OPS_TABLE
    gather_float8_as_bytes()
    gather_float8_as_bytes()  # idempotent
    assert FLOAT8_OPS_TABLE[op].moves_bytes_on_cpu


def test_without_torchao_the_plan_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if torchao were missing
    with pytest.raises(ConfigError, match=r"needs torchao, which is not installed: pip install -e '\.\[float8\]'"):
        resolve_plan(RECIPE.config(*FLOAT8), 1, "cpu")


def test_a_gpu_without_float8_matmuls_is_refused(monkeypatch):
    monkeypatch.setattr(float8_module.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(float8_module.torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert float8_problem("cuda") == (
        "[model] converters = ['float8'] needs float8 matmuls (compute capability 8.9+: H100, H200, L40S, RTX 4090); "
        "NVIDIA A100-SXM4-80GB has 8.0: drop float8 from [model] converters")
    monkeypatch.setattr(float8_module.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert float8_problem("cuda") is None


def test_selective_op_ac_counts_each_float8_linear_as_one_matmul():
    """SAC's dispatch mode sees a float8 linear as one ``aten.mm`` on torchao's float8 tensors (the mode runs before
    the tensor subclass, whose handler then calls the float8 matmul unseen): the every-second-matmul decisions are
    bf16's, and the casts to float8, like every other op, are recomputed, never saved. The GPU path differs only
    inside that handler (``_scaled_mm`` instead of the emulation)."""
    from tests.test_activation_checkpoint import SAVE, _block_decisions

    plain, _ = _block_decisions(every_second_matmul=True)
    with_float8, block = _block_decisions(every_second_matmul=True, float8=True)
    assert [(op, decision) for op, _, decision in with_float8] == [(op, decision) for op, _, decision in plain]
    assert sum(decision == SAVE for op, _, decision in with_float8 if op == "mm") == 8  # 4 of 7 per forward, twice
    assert type(block.attention.wq).__name__ == "Float8Linear"


def test_checkpoints_load_across_float8_on_and_off(tmp_path):
    """train.py on one process: float8 saves step 1, bf16 (here fp32) loads it and saves step 2, float8 loads that
    and trains step 3; each resumes the whole state (model, optimizer, scheduler, RNG)."""
    common = (*ONE_ROW, "--model.n_layers", "2", *FP32, "--checkpoint.enable", "--checkpoint.interval", "1",
              "--job.dump_folder", tmp_path)
    for step, float8 in ((1, True), (2, False), (3, True)):
        log = output_of(train_py(*common, "--training.steps", str(step), *(FLOAT8 if float8 else ()), timeout=120))
        assert f"saved step {step} to" in log and ("float8 tensorwise" in log) == float8
        if step > 1:
            assert f"loaded lr_scheduler, model, optimizer, rng from {tmp_path}/checkpoint/step-{step - 1}" in log


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(RECIPE, keep_grads=False)


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    """Each recipe's eager single-process run."""
    return {recipe: train_reference(RECIPE, *FLOAT8, f"--float8.recipe={recipe}", keep_grads=False)
            for recipe in ("tensorwise", "rowwise")}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_close_to_fp32_but_not_equal(recipe, reference, one_process):
    run = one_process[recipe]
    gap = max_rel_diff(run["losses"], reference["losses"])
    print(f"float8 {recipe} vs fp32: losses {gap:.1e}")
    assert FP32_GAP[0] < gap < FP32_GAP[1], (recipe, run["losses"], reference["losses"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_compiled_with_selective_op_ac_matches_eager(recipe, one_process):
    """One process, compiled with op-level selective AC (the recomputations, the casts included, run in Inductor's
    backward), against eager without AC (which selective AC does not change, tests/test_activation_checkpoint.py)."""
    compiled = train_reference(RECIPE, *FLOAT8, f"--float8.recipe={recipe}", "--compile.enable",
                               "--activation_checkpoint.mode=selective", keep_grads=False)
    eager = one_process[recipe]
    print(f"float8 {recipe} compiled vs eager: losses {max_rel_diff(compiled['losses'], eager['losses']):.1e}")
    assert max_rel_diff(compiled["losses"], eager["losses"]) <= COMPILED_RTOL
    assert max_rel_diff(compiled["norms"], eager["norms"]) <= NORM_RTOL


def _fully_shard(rank: int, world_size: int) -> dict:
    out = {}
    for recipe in SHARDED_RTOL:
        config = RECIPE.config(f"--training.local_batch_size={RECIPE.global_batch // world_size}", *FLOAT8,
                               f"--float8.recipe={recipe}", f"--parallelism.data_parallel_shard_degree={world_size}")
        out[recipe] = train_steps(build_layout(config, world_size), RECIPE)
    return out


def _dp2_tp2(rank: int, world_size: int) -> dict:
    from tests.test_float8_gather import _Collectives  # noqa: PLC0415

    out = {}
    for gather in (True, False):
        layout = build_layout(RECIPE.config(
            f"--training.local_batch_size={RECIPE.global_batch // 2}", *FLOAT8, f"--float8.all_gather={gather}",
            "--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"), world_size)
        counter = _Collectives()
        with counter:
            out[gather] = train_steps(layout, RECIPE)
        tp_group = layout.mesh["tp"].get_group().group_name
        out[gather]["tp_float8_gathers"] = counter.groups[("all_gather", "float8_e4m3fn", tp_group)]
        out[gather]["plan"] = "\n".join(layout.plan.describe())
    return out


@pytest.fixture(scope="module")
def worlds() -> dict[str, list[dict]]:
    """Every rank's results of the dp2 x tp2 (4 ranks) and the fully_shard (2 ranks) jobs, side by side: fully_shard
    compiles once (its follower waits for the leader), and the other world's work uses that core."""
    tp, fsdp = run_worlds_side_by_side([(_dp2_tp2, 4, ()), (_fully_shard, 2, ())])
    return {"dp2_tp2": tp, "fully_shard": fsdp}


@pytest.mark.slow
def test_float8_dp2_tp2_matches_one_process(one_process, worlds):
    """Tensor parallel with data parallel: each rank gathers its TP shard of a weight in float8, cast with the whole
    weight's scale (the amax all-reduced over dp and TP), bitwise the param-dtype gather; the activations cast to
    float8 on their sequence shards before TP's all-gather (the scale is the whole activation's, so the same bits as
    casting after it). Against one process within the tensorwise tolerance above (measured 2.1e-5 losses, 9.9e-5
    norms)."""
    for rank_result in worlds["dp2_tp2"]:
        on, off = rank_result[True], rank_result[False]
        assert (on["losses"], on["norms"]) == (off["losses"], off["norms"])
        # torchao's float8 TP styles: the normalized inputs of attention and feed-forward gathered over TP as float8
        # tensors (as uint8 on gloo, float8_gloo.py), 2 per block forward, 2 blocks, 3 steps
        assert on["tp_float8_gathers"] == off["tp_float8_gathers"] == 2 * 2 * RECIPE.steps
        assert "TP activations all-gathered in float8" in on["plan"]
        assert max_rel_diff(on["losses"], one_process["tensorwise"]["losses"]) <= SHARDED_RTOL["tensorwise"]
        assert max_rel_diff(on["norms"], one_process["tensorwise"]["norms"]) <= NORM_RTOL


@pytest.mark.slow
def test_float8_fully_shard_matches_one_process(one_process, worlds):
    for rank_result in worlds["fully_shard"]:
        for recipe, rtol in SHARDED_RTOL.items():
            loss_diff = max_rel_diff(rank_result[recipe]["losses"], one_process[recipe]["losses"])
            print(f"float8 {recipe} fully_shard vs one process: losses {loss_diff:.1e}")
            assert loss_diff <= rtol, recipe
            assert max_rel_diff(rank_result[recipe]["norms"], one_process[recipe]["norms"]) <= NORM_RTOL, recipe
