"""Llama 3 model: sizes, shapes, causality, meta-device init, RoPE, GQA, pipeline-stage forward, FLOPs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.distributed_utils import single_rank_process_group
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import (
    LLAMA3_FLAVORS,
    Attention,
    ModelArgs,
    Transformer,
    build_model,
    count_parameters,
    ffn_hidden_dim,
    flops_per_token,
)
from titan_simple.models.rope import LLAMA31_ROPE, precompute_freqs_cis, scale_rope_frequencies

TINY = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=100, multiple_of=32, max_seq_len=32)


def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(TINY, **overrides))


# ---------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "flavor, total, non_embedding, published",
    [
        ("8B", 8_030_261_248, 7_504_924_672, 8.03e9),
        ("70B", 70_553_706_496, 69_503_033_344, 70.6e9),
        ("405B", 405_853_388_800, 403_752_042_496, 405.9e9),
    ],
)
def test_parameter_counts_match_published(flavor, total, non_embedding, published):
    model = build_model(flavor)  # meta: no memory
    assert count_parameters(model) == total
    assert count_parameters(model, exclude_embedding=True) == non_embedding
    assert total - non_embedding == 128256 * model.args.dim  # only the token embedding is excluded
    assert abs(total - published) / published < 0.005


def test_ffn_hidden_dim_published_values():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert ffn_hidden_dim(16384, 4096, 1.2) == 53248
    assert ffn_hidden_dim(256, 256, None) == 768


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_large"])
@pytest.mark.parametrize("tp", [2, 4])
def test_debug_flavors_shard_evenly_for_tensor_parallel(flavor, tp):
    a = LLAMA3_FLAVORS[flavor]
    hidden = ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier)
    for size in (a.n_heads, a.n_kv_heads, a.vocab_size, hidden):
        assert size % tp == 0


def test_unknown_flavor_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match="debugmodel.*8B.*70B.*405B"):
        build_model("7B")


def test_build_model_overrides_and_does_not_touch_the_presets():
    model = build_model("debugmodel", vocab_size=512, max_seq_len=64, device="cpu")
    assert model.args.vocab_size == 512 and model.output.weight.shape == (512, 256)
    assert model.freqs_cis.shape == (64, 8)
    assert LLAMA3_FLAVORS["debugmodel"].vocab_size == 2000
    assert LLAMA3_FLAVORS["debugmodel"].max_seq_len == 8192


# ---------------------------------------------------------------------------------------------- forward


def test_debugmodel_forward_shapes():
    model = build_model("debugmodel", max_seq_len=64, device="cpu")
    tokens = torch.randint(0, 2000, (2, 48))
    logits = model(tokens)
    assert logits.shape == (2, 48, 2000)
    assert torch.isfinite(logits).all()


def test_too_long_sequence_is_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_causality_future_tokens_do_not_change_earlier_logits():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_explicit_repeat_of_kv_heads():
    args = dataclasses.replace(TINY, n_heads=8, n_kv_heads=2)
    torch.manual_seed(0)
    attention = Attention(args)
    attention.init_weights(out_init_std=0.02)
    x = torch.randn(2, 12, args.dim)
    freqs_cis = precompute_freqs_cis(args.head_dim, 12, args.rope_theta)

    # Reference written out by hand: rotate, repeat each KV head n_heads / n_kv_heads times, masked softmax.
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 12, -1, args.head_dim)

    q = rotate(heads(attention.wq(x)), freqs_cis).transpose(1, 2)
    k = rotate(heads(attention.wk(x)), freqs_cis).transpose(1, 2).repeat_interleave(4, dim=1)
    v = heads(attention.wv(x)).transpose(1, 2).repeat_interleave(4, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(args.head_dim)
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    expected = attention.wo((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, 12, -1))

    torch.testing.assert_close(attention(x, freqs_cis), expected, rtol=1e-5, atol=1e-5)


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE with real arithmetic: channel pairs (2j, 2j+1) rotated by angle(freqs_cis[t, j])."""
    cos, sin = freqs_cis.real[None, :, None, :], freqs_cis.imag[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def test_attention_with_column_sharded_projections_uses_local_heads():
    """As under tensor parallel: wq/wk/wv hold half the heads, wo half the input columns."""
    args = TINY
    torch.manual_seed(0)
    full = Attention(args)
    half = Attention(args)
    q_rows, kv_rows = args.dim // 2, args.n_kv_heads * args.head_dim // 2
    with torch.no_grad():
        half.wq.weight = torch.nn.Parameter(full.wq.weight[:q_rows].clone())
        half.wk.weight = torch.nn.Parameter(full.wk.weight[:kv_rows].clone())
        half.wv.weight = torch.nn.Parameter(full.wv.weight[:kv_rows].clone())
        half.wo.weight = torch.nn.Parameter(full.wo.weight[:, :q_rows].clone())
        other = Attention(args)
        other.wq.weight = torch.nn.Parameter(full.wq.weight[q_rows:].clone())
        other.wk.weight = torch.nn.Parameter(full.wk.weight[kv_rows:].clone())
        other.wv.weight = torch.nn.Parameter(full.wv.weight[kv_rows:].clone())
        other.wo.weight = torch.nn.Parameter(full.wo.weight[:, q_rows:].clone())
        x = torch.randn(2, 8, args.dim)
        freqs_cis = precompute_freqs_cis(args.head_dim, 8, args.rope_theta)
        torch.testing.assert_close(half(x, freqs_cis) + other(x, freqs_cis), full(x, freqs_cis))


def test_pipeline_stages_run_on_hidden_states():
    model = tiny_model(n_layers=4)
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))
    with torch.no_grad():
        expected = model(tokens)
        first, last = tiny_model(n_layers=4), tiny_model(n_layers=4)  # same seed: same weights
        del first.layers["2"], first.layers["3"]
        first.norm = first.output = None
        del last.layers["0"], last.layers["1"]
        last.tok_embeddings = None
        hidden = first(tokens)
        assert hidden.shape == (2, 10, TINY.dim)
        torch.testing.assert_close(last(hidden), expected)
    assert "layers.3.attention.wq.weight" in dict(last.named_parameters())
    last.init_weights()  # missing pieces are skipped


# ---------------------------------------------------------------------------------------------- init


def test_meta_build_then_init_matches_expected_statistics():
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].attention.wq.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)

    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
    std = {name: param.std().item() for name, param in model.named_parameters()}
    assert std["layers.0.attention.wq.weight"] == pytest.approx(0.02, rel=0.1)
    assert std["layers.5.feed_forward.w1.weight"] == pytest.approx(0.02, rel=0.1)
    for layer in range(args.n_layers):  # depth-scaled output projections
        expected = 0.02 / math.sqrt(2 * (layer + 1))
        for suffix in ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"):
            assert std[f"layers.{layer}.{suffix}"] == pytest.approx(expected, rel=0.1)
    assert std["tok_embeddings.weight"] == pytest.approx(1.0, rel=0.1)
    out = model.output.weight
    assert std["output.weight"] == pytest.approx(args.dim**-0.5, rel=0.1)
    assert out.abs().max() <= 3 * args.dim**-0.5 + 1e-6
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    assert torch.equal(model.layers["2"].ffn_norm.weight, torch.ones(args.dim))

    fresh = Transformer(args)
    assert model.freqs_cis.device.type == "cpu"
    assert torch.equal(model.freqs_cis, fresh.freqs_cis)
    assert "freqs_cis" not in model.state_dict()


def test_uniform_depth_init():
    model = build_model("debugmodel", max_seq_len=16, device="cpu")
    model.args.depth_init = False  # a copy: the preset is untouched
    flat = Transformer(model.args)
    expected = 0.02 / math.sqrt(2 * 6)
    for layer in ("0", "5"):
        assert flat.layers[layer].attention.wo.weight.std().item() == pytest.approx(expected, rel=0.1)


@pytest.mark.filterwarnings("ignore:DTensor random operators:UserWarning")
def test_init_weights_works_on_dtensor_parameters():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with single_rank_process_group():
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            model = Transformer(TINY)
        model.to_empty(device="cpu")
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
                module.register_parameter(name, torch.nn.Parameter(sharded))
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        wq = model.layers["0"].attention.wq.weight
        assert isinstance(wq, DTensor)
        assert torch.isfinite(wq.full_tensor()).all() and wq.full_tensor().std().item() > 0
        assert count_parameters(model) == count_parameters(Transformer(TINY))


# ---------------------------------------------------------------------------------------------- RoPE


def test_rope_scaling_keeps_high_and_divides_lowest_frequencies():
    head_dim, theta = 128, 500000.0
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled = scale_rope_frequencies(freqs)
    wavelength = 2 * math.pi / freqs
    high = wavelength < 8192 / 4
    low = wavelength > 8192 / 1
    assert high.any() and low.any()
    assert torch.equal(scaled[high], freqs[high])
    assert torch.equal(scaled[low], freqs[low] / 8)
    assert scaled[-1] == freqs[-1] / 8  # the lowest frequency
    between = ~high & ~low
    assert ((scaled[between] < freqs[between]) & (scaled[between] > freqs[between] / 8)).all()

    table = precompute_freqs_cis(head_dim, 16, theta, scaling=LLAMA31_ROPE)
    assert table.shape == (16, 64) and table.dtype == torch.complex64
    torch.testing.assert_close(table[5].angle(), torch.remainder(5 * scaled + math.pi, 2 * math.pi) - math.pi)


def test_rope_buffer_is_sliced_to_the_sequence_length():
    model = tiny_model()
    assert model.freqs_cis.shape == (TINY.max_seq_len, TINY.head_dim // 2)
    torch.testing.assert_close(model.freqs_cis.abs(), torch.ones(TINY.max_seq_len, TINY.head_dim // 2))
    model(torch.zeros(1, 5, dtype=torch.long))  # shorter than max_seq_len


# ---------------------------------------------------------------------------------------------- FLOPs


def test_flops_per_token_8b():
    args = LLAMA3_FLAVORS["8B"]
    n = count_parameters(build_model("8B"), exclude_embedding=True)
    assert n == 7_504_924_672
    by_hand = 6 * 7_504_924_672 + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, 8192) == by_hand == 57_914_449_920
