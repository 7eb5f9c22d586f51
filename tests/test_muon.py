"""Muon (``[optimizer] name = "Muon"``, core/muon.py) against torch's own ``torch.optim.Muon`` + ``torch.optim.AdamW``,
and its owner exchange (parallel/matrix_owners.py): each matrix whole on one rank, once per step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_simple.config import load_job_config
from titan_simple.core.muon import (
    BLOCK_MATRIX,
    newton_schulz,
    newton_schulz_flops,
    split_parameters,
)
from titan_simple.core.optim import build_muon
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer
from titan_simple.parallel.matrix_owners import assign_owners

SEQ, BATCH, STEPS = 32, 2, 8


def _muon_config(*overrides: str):
    return load_job_config(["--config", "llama3_debug.toml", "--optimizer.name", "Muon",
                            "--training.mixed_precision_param", "float32", *overrides])


def _debug_model(n_layers: int = 6) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=n_layers))


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [("original", False), ("match_rms_adamw", True)])
def test_muon_with_adamw_equals_torchs_muon_and_adamw_stepped_by_hand(adjust_lr_fn, nesterov):
    """One process, fp32, the debug model's block (one: torch's bf16 Newton-Schulz is ~50x slower than fp32 on a CPU
    without native bf16, and every block runs the same shapes), 8 steps on the same batches: every weight after every
    step equals torch's optimizers' (Muon on the block matrices, AdamW on the rest) to 1e-6 of its largest entry.
    Both adjust_lr_fn choices and Nesterov on and off, in two runs."""
    config = _muon_config("--optimizer.muon_adjust_lr_fn", adjust_lr_fn, f"--optimizer.muon_nesterov={nesterov}",
                          "--optimizer.lr", "3e-3", "--optimizer.muon_lr", "2e-2", "--optimizer.weight_decay", "0.1",
                          "--optimizer.muon_weight_decay", "0.05")
    ours, reference = _debug_model(1), _debug_model(1)
    optimizer = build_muon(ours, config)
    muon, adamw, _ = split_parameters(reference.named_parameters())
    torch_muon = torch.optim.Muon([p for _, p in muon], lr=2e-2, weight_decay=0.05, momentum=0.95, nesterov=nesterov,
                                  adjust_lr_fn=adjust_lr_fn)
    torch_adamw = torch.optim.AdamW([p for _, p in adamw], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                    foreach=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, 2000, (BATCH, SEQ + 1), generator=generator)
        for model, optimizers in ((ours, (optimizer,)), (reference, (torch_muon, torch_adamw))):
            _loss(model, tokens).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
        for (name, mine), theirs in zip(ours.named_parameters(), reference.parameters(), strict=True):
            scale = theirs.abs().max().item()
            assert (mine - theirs).abs().max().item() <= 1e-6 * scale, (step, name)
    assert optimizer.newton_schulz_calls == STEPS * len(muon)  # one process: it owns every matrix


def test_the_block_matrices_take_muon_and_everything_else_adamw():
    muon, adamw, excluded = split_parameters(_debug_model().named_parameters())
    assert len(muon) == 6 * 7 and all(BLOCK_MATRIX.search(n) for n, _ in muon)
    assert {n.split(".")[-2] for n, _ in muon} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert {n for n, _ in adamw} == {"tok_embeddings.weight", "norm.weight", "output.weight", *(
        f"layers.{i}.{norm}.weight" for i in range(6) for norm in ("attention_norm", "ffn_norm"))}
    assert excluded == []
    _, kept, excluded = split_parameters(_debug_model().named_parameters(), ["feed_forward.w2"])
    assert excluded == [f"layers.{i}.feed_forward.w2.weight" for i in range(6)] and len(kept) == 15 + 6


def test_newton_schulz_in_float32_orthogonalizes_and_bf16_matches_torch():
    """Our iteration is torch.optim.Muon's (bf16, bitwise); in float32 it gives singular values near 1 (torch's
    coefficients overshoot on purpose: Uniform(0.5, 1.5)-ish, not exactly 1)."""
    from torch.optim._muon import _zeropower_via_newtonschulz  # the oracle: torch's own

    g = torch.Generator().manual_seed(0)
    for shape in ((64, 32), (32, 96)):
        matrix = torch.randn(*shape, generator=g)
        ours = newton_schulz(matrix, 5, torch.bfloat16)
        theirs = _zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(ours, theirs)
        singular = torch.linalg.svdvals(newton_schulz(matrix, 5, torch.float32))
        assert 0.5 < singular.min() and singular.max() < 1.5
    assert newton_schulz_flops((768, 256), 5) == 5 * (4 * 256 * 256 * 768 + 2 * 256**3)


def test_owners_are_balanced_by_flops_and_agreed_from_the_costs_alone():
    costs = [8.0, 1.0, 1.0, 4.0, 4.0, 2.0]
    owners = assign_owners(costs, (0, 1, 2))
    loads = {r: sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in (0, 1, 2)}
    assert owners == [0, 2, 2, 1, 2, 1] and loads == {0: 8.0, 1: 6.0, 2: 6.0}  # costliest first, to the least loaded
    assert assign_owners(costs, (0, 1, 2)) == owners


def test_the_plan_names_what_muon_takes_and_bad_input_is_one_line(capsys):
    """The plan's line counts each optimizer's parameters and names block matrices left on AdamW, once; every bad
    setting is one line and exit status 2 before anything is built."""
    import train

    plan = resolve_plan(_muon_config("--optimizer.muon_exclude", '["feed_forward.w2"]'), 1, "cpu")
    line = next(line for line in plan.describe() if "optimizer:" in line)
    assert line == ("  optimizer: Muon for 36 block matrices (3.54M parameters), AdamW for 21 others (2.21M) | "
                    "Newton-Schulz 5 steps in bfloat16, lr adjusted match_rms_adamw; left on AdamW by muon_exclude: "
                    "layers.0.feed_forward.w2.weight, layers.1.feed_forward.w2.weight, "
                    "layers.2.feed_forward.w2.weight and 3 more")
    assert not any("optimizer:" in line for line in resolve_plan(load_job_config([]), 1, "cpu").describe())
    cases = [
        (("--optimizer.name", "Muon", "--optimizer.muon_exclude", '["layers."]'), "has no block matrix for it"),
        (("--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"), "muon_ns_steps = 0 is impossible"),
        (("--optimizer.name", "Muon", "--optimizer.muon_momentum", "1.0"), "muon_momentum = 1.0 is impossible"),
        (("--optimizer.name", "Muon", "--optimizer.muon_adjust_lr_fn", "spectral"), "muon_adjust_lr_fn = 'spectral'"),
        (("--optimizer.name", "Adam", "--optimizer.muon_lr", "0.02"), "muon_lr is set but name = 'Adam'"),
    ]
    for args, message in cases:
        assert train.main(["--config", "llama3_debug.toml", *args]) == 2, args
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (args, errors)
    with pytest.raises(ConfigError, match="found no block matrix to train"):  # a stage holding none of them
        build_muon(_debug_model(), _muon_config("--optimizer.muon_exclude", '["layers."]'))


def test_the_dry_run_prices_muon_state_owners_and_all_to_alls(tmp_path):
    """4 ranks of the 2-block debug model on H100s: Muon keeps one momentum buffer per matrix block where AdamW
    keeps two (the matrices' share of the state halves), the 14 matrices are owned over the 4 ranks, and the two
    all-to-alls are priced in the optimizer step."""
    from tests.test_dry_run import dry_run

    common = ("--config", "llama3_debug.toml", "--model.n_layers", "2", "--dry_run.world_size", "4",
              "--dry_run.device", "h100")
    adamw_proc, adamw = dry_run(tmp_path / "adamw", *common)
    muon_proc, muon = dry_run(tmp_path / "muon", *common, "--optimizer.name", "Muon")
    assert adamw_proc.returncode == 0 and muon_proc.returncode == 0, muon_proc.stderr[-2000:]
    matrices, _, _ = split_parameters(_debug_model(2).named_parameters())
    matrix_bytes = sum(p.numel() for _, p in matrices) * 4 // 4  # fp32, sharded over 4 ranks
    saved = adamw["memory_bytes"]["optimizer_state"] - muon["memory_bytes"]["optimizer_state"]
    assert abs(saved - matrix_bytes) <= 4096, (saved, matrix_bytes)  # one moment of every matrix, less
    assert muon["muon"]["matrices"] == 14 and muon["muon"]["owners"] == 4 and muon["muon"]["seconds"] > 0
    kinds = {(c["kind"], c["dtype"]) for c in muon["collectives_per_step"]}
    assert {("all_to_all", "float32"), ("all_to_all", "bfloat16")} <= kinds  # blocks to owners; results back
    assert muon["time_seconds"]["optimizer"] > adamw["time_seconds"]["optimizer"] + muon["muon"]["seconds"] * 0.99
    assert "Muon: Newton-Schulz" in muon_proc.stdout
