"""Op-level selective activation checkpointing: which ops each policy saves, that recomputing changes no number,
and what it does under tensor parallel (sequence-parallel inputs gathered again in backward, sequence shards kept)."""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from tests.harness import DEBUG, train_py, two_at_a_time
from tests.parity import Recipe, build_layout, train_steps
from titan_simple.models.llama3 import LLAMA3_FLAVORS, TransformerBlock, precompute_freqs_cis
from titan_simple.parallel.activation_checkpoint import SelectiveOpPolicy, apply_checkpoint

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


class _Recording(SelectiveOpPolicy):
    """The policy, recording each projection's decision with its output width, each attention's decision and (into
    ``bmm_log``) each batched matmul's."""

    log: list[tuple[str, int, CheckpointPolicy]] = []
    bmm_log: list[tuple[str, CheckpointPolicy]] | None = None

    def fresh(self) -> _Recording:
        return _Recording(self.every_second_matmul)

    def __call__(self, ctx, op, *args, **kwargs):
        decision = super().__call__(ctx, op, *args, **kwargs)
        name = str(op)
        if op is torch.ops.aten.bmm.default:
            if _Recording.bmm_log is not None:
                square = args[1].shape[-1] == args[0].shape[-2]
                _Recording.bmm_log.append(("scores" if square else "attention output", decision))
        elif "mm" in name:
            _Recording.log.append(("mm", args[1].shape[-1], decision))
        elif "attention" in name:
            _Recording.log.append(("attention", 0, decision))
        return decision


def _block_decisions(every_second_matmul: bool, float8: bool = False, bmm_log: list | None = None,
                     seq: int = 16) -> tuple[list, TransformerBlock]:
    args = LLAMA3_FLAVORS["debugmodel"]
    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    if float8:  # tests/test_float8.py
        from titan_simple.models.float8 import convert_to_float8

        convert_to_float8(block, "tensorwise", [], emulate=True)
    apply_checkpoint(block, _Recording(every_second_matmul))
    freqs = precompute_freqs_cis(args.head_dim, seq, args.rope_theta)
    x = torch.randn(2, seq, args.dim, requires_grad=True)
    _Recording.log, _Recording.bmm_log = [], bmm_log
    for _ in range(2):  # the count restarts for every checkpointed forward
        block(x, freqs).sum().backward()
    _Recording.bmm_log = None
    return _Recording.log, block


def test_op_policy_saves_attention_and_every_second_matmul():
    log, block = _block_decisions(every_second_matmul=True)
    attention, ffn = block.attention, block.feed_forward
    # Call order wq, wk, wv, (attention), wo, w1, w3, w2: the 1st, 3rd, 5th and 7th matmul are saved.
    one_forward = [
        ("mm", attention.wq.out_features, SAVE), ("mm", attention.wk.out_features, RECOMPUTE),
        ("mm", attention.wv.out_features, SAVE), ("attention", 0, SAVE), ("mm", attention.wo.out_features, RECOMPUTE),
        ("mm", ffn.w1.out_features, SAVE), ("mm", ffn.w3.out_features, RECOMPUTE), ("mm", ffn.w2.out_features, SAVE),
    ]
    assert log == one_forward * 2


def test_sdpa_math_fallback_keeps_the_projections_decisions_and_recomputes_the_scores():
    """SDPA's math kernel runs attention as two batched matmuls: they do not count as projections (the decisions on
    wq .. w2 stay the fused kernel's), the score matrix Q K^T is recomputed as a fused kernel would, and P.V -- the
    attention output -- saved as a fused kernel's output is."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused, _ = _block_decisions(every_second_matmul=True)
    log, decisions = [], {}
    with sdpa_kernel(SDPBackend.MATH):
        math_log, block = _block_decisions(every_second_matmul=True, bmm_log=log, seq=32)  # scores 32 x 32
    assert [entry for entry in math_log if entry[0] == "mm"] == [entry for entry in fused if entry[0] == "mm"]
    for kind, decision in log:
        decisions.setdefault(kind, set()).add(decision)
    assert decisions == {"scores": {RECOMPUTE}, "attention output": {SAVE}}


def test_op_policy_counts_a_recomputation_apart_from_its_forward():
    """torch 2.11 calls the policy again while recomputing (ctx.is_recompute): the recomputation must see the
    forward's decisions, not a count that runs on (it recomputed wk from wq's output, eagerly, on torch 2.11)."""
    policy = SelectiveOpPolicy(every_second_matmul=True).fresh()
    mm = torch.ops.aten.mm.default
    forward = [policy(SimpleNamespace(is_recompute=False), mm) for _ in range(7)]
    recomputed = [policy(SimpleNamespace(is_recompute=True), mm) for _ in range(7)]
    assert forward == recomputed == [SAVE, RECOMPUTE, SAVE, RECOMPUTE, SAVE, RECOMPUTE, SAVE]


def test_each_module_runs_its_own_policy_whatever_ran_before_in_the_process():
    """The context_fn names its policy by cache key, process-wide: a module checkpointed with the plain op policy
    first must not make a later recording subclass (same decisions, same settings) run the earlier policy (it did,
    depending on test order), and two classes under one key are refused rather than silently swapped."""
    from titan_simple.parallel import activation_checkpoint as ac

    # the base class's policy first (in a fresh process, the first under its key)
    apply_checkpoint(TransformerBlock(0, LLAMA3_FLAVORS["debugmodel"]), SelectiveOpPolicy(every_second_matmul=True))
    log, _ = _block_decisions(every_second_matmul=True)
    assert sum(decision == SAVE for op, _, decision in log if op == "mm") == 8  # 4 of 7 per forward, twice

    class Impostor:
        cache_key = "selective_op(every second matmul)"

        def __call__(self, ctx, op, *args, **kwargs):
            return RECOMPUTE

    with pytest.raises(ValueError, match="share the cache key"):
        ac._context_fn(ac.compose_policies(Impostor()))


def test_op_all_matmuls_policy_saves_every_matmul():
    log, _ = _block_decisions(every_second_matmul=False)
    assert [decision for _, _, decision in log] == [SAVE] * 16


@pytest.mark.parametrize("option", ["op", "op_all_matmuls", "2"])
def test_selective_ac_changes_no_loss_or_gradient_bitwise(option):
    """fp32 on one process: recomputing runs the same kernels on the same inputs, so every loss and every
    first-step gradient is bitwise the one without checkpointing."""
    recipe = Recipe(global_batch=2, seq_len=32, steps=3)

    def run(*overrides: str) -> dict:
        torch.manual_seed(0)
        layout = build_layout(recipe.config("--training.local_batch_size=2", *overrides))
        return train_steps(layout, recipe, keep_grads=True)

    plain = run()
    checkpointed = run("--activation_checkpoint.mode=selective",
                       f"--activation_checkpoint.selective_ac_option={option}")
    assert checkpointed["losses"] == plain["losses"]
    assert all(torch.equal(checkpointed["grads"][k], g) for k, g in plain["grads"].items())


def _tp_dry_run(tmp_path: Path, tp: int, *ac: str) -> tuple[dict[tuple[str, str], int], int]:
    """The dry run's trace of one step of one rank of 4 (dp4, or dp2 x tp2), recomputation included: the
    collectives per step and the activation bytes."""
    folder = tmp_path / f"tp{tp}_{'_'.join(ac or ('none',)).replace('-', '')}"
    train_py("--dry_run", *DEBUG, "--dry_run.world_size", "4", "--dry_run.device", "h100",
             "--parallelism.tensor_parallel_degree", str(tp), "--training.seq_len", "512",
             "--training.local_batch_size", "2", "--job.dump_folder", folder, *ac)
    report = json.loads((folder / "dry_run.json").read_text())
    collectives = collections.Counter()
    for c in report["collectives_per_step"]:
        collectives[(c["mesh_dim"], c["kind"])] += c["count"]
    return dict(collectives), report["memory_bytes"]["activations"]


@pytest.mark.slow
def test_selective_op_ac_regathers_sequence_parallel_inputs_and_keeps_sequence_shards(tmp_path):
    """dp2 x tp2, the debug model's 6 blocks: with the op-level policies each sublayer's sequence-parallel all-gather
    runs once more, in backward (12 = 2 per block), and every other tensor-parallel collective exactly as often as
    without checkpointing; full AC reruns more. What a rank keeps for backward then falls with the degree: at tp2
    at most 0.6 of dp4's at the same local batch (measured 0.565; 0.824 when the gathered inputs and the row-parallel
    matmuls' partial sums were saved, full-sequence tensors both)."""
    op = ("--activation_checkpoint.mode=selective",)
    settings = [(2,), *[(2, *op, f"--activation_checkpoint.selective_ac_option={o}") for o in ("op", "op_all_matmuls")],
                (2, "--activation_checkpoint.mode=full"), (1, *op)]
    (plain, _), *selective, (full, _), (_, tp1_activations) = two_at_a_time(
        [functools.partial(_tp_dry_run, tmp_path, *s) for s in settings])
    tp = {key: n for key, n in plain.items() if key[0] == "tp"}
    assert tp and all(n > 0 for n in tp.values())
    blocks = 6
    for option, (counts, activations) in zip(("op", "op_all_matmuls"), selective, strict=True):
        expected = {**tp, ("tp", "all_gather"): tp[("tp", "all_gather")] + 2 * blocks}
        assert {key: n for key, n in counts.items() if key[0] == "tp"} == expected, option
        if option == "op":
            assert activations <= 0.6 * tp1_activations, (activations, tp1_activations)
    assert sum(n for key, n in full.items() if key[0] == "tp") > sum(tp.values()) + 2 * blocks
