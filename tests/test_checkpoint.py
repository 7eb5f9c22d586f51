"""Checkpoints: exact resume (sync and async), atomic folders, keep_latest_k, failures, resharding, HF weights.

The trainer runs in-process on the debug model with a tiny batch (2 x 32 tokens); multi-process runs use
spawned gloo ranks (``run_on_ranks``) so the test can read the full weights back from the ranks and compare
them with what another layout loads.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tests.distributed_utils import run_on_ranks
from titan_simple.config import load_job_config
from titan_simple.core.step import StepHooks
from titan_simple.errors import CheckpointError, ConfigError
from titan_simple.models.hf_llama import (
    from_hf_name,
    half_split_to_interleaved,
    interleaved_to_half_split,
    is_hf_folder,
    save_hf,
    to_hf_name,
)
from titan_simple.models.llama3 import ModelArgs, Transformer, apply_rotary_emb, build_model, precompute_freqs_cis
from titan_simple.parallel.simple_fsdp import sharded_parameters
from titan_simple.trainer.checkpoint import (
    MARKER,
    complete_steps,
    export_hf,
    find_checkpoint,
    load_model_weights,
)
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.trainer import Trainer

TINY = ["--config", "llama3_debug.toml", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0.5", "--metrics.log_freq", "100",
        "--metrics.enable_tensorboard", "false"]


def make_trainer(dump: Path, *extra: str, steps: int = 6, dist_info: DistInfo | None = None) -> Trainer:
    argv = [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]
    return Trainer(load_job_config(argv), dist_info=dist_info)


def stop_with_sigterm_after(trainer: Trainer, step: int) -> None:
    """Deliver a real SIGTERM during ``step``: the trainer finishes it, saves, and returns."""

    class Sigterm(StepHooks):
        def begin(self) -> None:
            if trainer.step == step:
                signal.raise_signal(signal.SIGTERM)

    trainer.step_fn.hooks = Sigterm()


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters (all of them unless pipeline parallel), unsharded (a collective)."""
    with sharded_parameters():
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for part in trainer.model_parts for name, p in part.named_parameters()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    assert worst == 0.0, f"max weight difference {worst}"


# ------------------------------------------------------------------------------------ one process


def test_sigterm_saves_and_resume_gives_identical_losses(tmp_path):
    uninterrupted = make_trainer(tmp_path / "full", steps=4).train()
    first = make_trainer(tmp_path / "run", "--checkpoint.enable", "--checkpoint.interval", "100", steps=4)
    stop_with_sigterm_after(first, 2)
    assert len(first.train()) == 2
    assert complete_steps(tmp_path / "run" / "checkpoint") == [2]  # saved on the stop request

    resumed = make_trainer(tmp_path / "run", "--checkpoint.enable", "--checkpoint.interval", "100", steps=4)
    assert (resumed.step, resumed.tokens_seen) == (2, 2 * 64)
    assert resumed.train() == uninterrupted[2:]  # bitwise
    assert complete_steps(tmp_path / "run" / "checkpoint") == [2, 4]  # the last step always saves


def test_partial_checkpoints_are_ignored_with_a_warning(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    for step in (2, 4):  # complete ones
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / MARKER).write_text("{}")
    (folder / "step-6.partial").mkdir()  # killed while writing
    (folder / "step-8").mkdir()  # no marker: not complete either
    with caplog.at_level(logging.WARNING, logger="titan_simple"):
        assert find_checkpoint(folder) == folder / "step-4"
    assert "step-6.partial" in caplog.text and "step-8" in caplog.text
    with pytest.raises(ConfigError, match=r"load_step = 8: no complete checkpoint .*complete steps in .*: 2, 4\)"):
        find_checkpoint(folder, 8)
    with pytest.raises(ConfigError, match="partial"):
        load_model_weights(str(folder / "step-6.partial"), build_model("debugmodel", device="cpu"))


def test_keep_latest_k_and_a_failing_save_leaves_older_checkpoints(tmp_path, monkeypatch):
    options = ["--checkpoint.enable", "--checkpoint.interval", "1"]
    trainer = make_trainer(tmp_path, *options, "--checkpoint.keep_latest_k", "1", steps=4)
    original_write = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step-3" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original_write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    with pytest.raises(CheckpointError) as failure:
        trainer.train()
    message = str(failure.value)
    assert "\n" not in message and "saving step 3" in message and "No space left on device" in message
    assert "newest complete one is" in message and "step-2" in message
    folder = tmp_path / "checkpoint"
    assert complete_steps(folder) == [2]  # keep_latest_k = 1 deleted step 1; step 3 never became visible
    assert (folder / "step-3.partial").is_dir()
    monkeypatch.undo()

    # Resume from step 2 with keep_latest_k = 2; the leftover partial folder is replaced when step 3 saves.
    again = make_trainer(tmp_path, *options, "--checkpoint.keep_latest_k", "2", steps=4)
    assert again.step == 2
    again.train()
    assert complete_steps(folder) == [3, 4]
    assert not list(folder.glob("*.partial"))


def test_corrupt_or_mismatched_checkpoints_fail_with_one_line(tmp_path):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "2", steps=2)
    trainer.train()
    step = tmp_path / "checkpoint" / "step-2"
    plain = build_model("debugmodel", max_seq_len=32, device="cpu")
    load_model_weights(str(step), plain)  # fine before we break it

    other_flavor = build_model("debugmodel_large", max_seq_len=32, device="cpu")
    with pytest.raises(ConfigError, match=r"does not match the model: .*shape mismatch .*check \[model\] flavor"):
        load_model_weights(str(step), other_flavor)

    (shard,) = step.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    with pytest.raises(CheckpointError, match="corrupt or truncated") as failure:
        make_trainer(tmp_path, "--checkpoint.enable", steps=4)
    assert "\n" not in str(failure.value)

    (step / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):
        load_model_weights(str(step), plain)
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_weights(str(tmp_path / "nowhere"), plain)


def test_seed_checkpoint_then_initial_load(tmp_path):
    seed = make_trainer(tmp_path / "seed", "--checkpoint.create_seed_checkpoint", "--training.seed", "7")
    assert seed.train() == []
    seed_step = tmp_path / "seed" / "checkpoint" / "step-0"
    assert complete_steps(seed_step.parent) == [0]
    seeded = make_trainer(tmp_path / "run", "--checkpoint.initial_load_path", str(seed_step))
    assert seeded.step == 0
    assert_same_weights(full_weights(seeded), full_weights(seed))


# ------------------------------------------------------------------------------------ Hugging Face


def tiny_args() -> ModelArgs:
    return ModelArgs(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=16, max_seq_len=8)


def test_hf_layout_matches_hand_written_llama_names(tmp_path):
    args = tiny_args()
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Transformer(args)
    save_hf(model.state_dict(), args, tmp_path)
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "model.safetensors"))
    expected = {"model.embed_tokens.weight": [32, 16], "model.norm.weight": [16], "lm_head.weight": [32, 16]}
    for i in range(2):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [16, 16], p + "self_attn.k_proj.weight": [8, 16],
            p + "self_attn.v_proj.weight": [8, 16], p + "self_attn.o_proj.weight": [16, 16],
            p + "mlp.gate_proj.weight": [48, 16], p + "mlp.up_proj.weight": [48, 16],
            p + "mlp.down_proj.weight": [16, 48],
            p + "input_layernorm.weight": [16], p + "post_attention_layernorm.weight": [16],
        })
    assert {k: list(v.shape) for k, v in hf.items()} == expected
    assert to_hf_name("layers.1.feed_forward.w2.weight") == "model.layers.1.mlp.down_proj.weight"
    assert from_hf_name("model.layers.1.post_attention_layernorm.weight") == "layers.1.ffn_norm.weight"
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], model.layers["0"].attention.wv.weight)
    # Rows of each q head: ours interleave (re, im) pairs, HF's put all re first: head 0 rows 0,2,1,3 of
    # a head_dim-4 model become 0,1 | 2,3 -> hand-checked on a 2-head, head_dim-4 matrix.
    rows = torch.arange(8.0).unsqueeze(1)
    assert interleaved_to_half_split(rows, n_heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(half_split_to_interleaved(interleaved_to_half_split(rows, 2), 2), rows)
    import json

    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (16, 48, 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_hf_rope_permutation_gives_the_same_attention_scores_as_hf_rotate_half(tmp_path):
    """Hugging Face's RoPE (rotate_half over half-split channels) on the exported q/k weights gives the
    attention scores our interleaved RoPE gives on ours."""
    args = tiny_args()
    torch.manual_seed(0)
    model = Transformer(args)
    save_hf(model.state_dict(), args, tmp_path)
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "model.safetensors"))
    seq, head_dim = 8, args.head_dim
    x = torch.randn(1, seq, args.dim)
    attn = model.layers["0"].attention
    freqs = precompute_freqs_cis(head_dim, seq, args.rope_theta)
    q = apply_rotary_emb((x @ attn.wq.weight.T).view(1, seq, args.n_heads, head_dim), freqs)
    k = apply_rotary_emb((x @ attn.wk.weight.T).view(1, seq, args.n_kv_heads, head_dim), freqs)

    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    q_hf = (x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(1, seq, args.n_heads, head_dim)
    k_hf = (x @ hf["model.layers.0.self_attn.k_proj.weight"].T).view(1, seq, args.n_kv_heads, head_dim)
    q_hf, k_hf = q_hf * cos + _rotate_half(q_hf) * sin, k_hf * cos + _rotate_half(k_hf) * sin

    repeat = args.n_heads // args.n_kv_heads
    ours = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(repeat, dim=2))
    theirs = torch.einsum("bqhd,bkhd->bhqk", q_hf, k_hf.repeat_interleave(repeat, dim=2))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_hf_export_import_round_trip_gives_identical_weights_and_logits(tmp_path):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--checkpoint.last_save_in_hf", steps=2)
    trainer.train()
    step = tmp_path / "checkpoint" / "step-2"
    assert is_hf_folder(step / "hf")  # written by last_save_in_hf
    umask = os.umask(0)
    os.umask(umask)
    assert (step / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # readable as config.json
    exported = export_hf(step, tmp_path / "hf_script")  # what scripts/export_hf.py does
    assert (exported / "model.safetensors").read_bytes() == (step / "hf" / "model.safetensors").read_bytes()

    original = build_model("debugmodel", max_seq_len=32, device="cpu")
    load_model_weights(str(step), original)
    imported = build_model("debugmodel", max_seq_len=32, device="cpu")
    load_model_weights(str(exported), imported)
    assert_same_weights(dict(original.named_parameters()), dict(imported.named_parameters()))
    assert_same_weights(dict(original.named_parameters()), full_weights(trainer))
    tokens = torch.randint(0, 2000, (2, 32))
    with torch.no_grad():
        assert torch.equal(original(tokens), imported(tokens))

    # Import into the trainer through initial_load_path: the same loss on the first batch as the original.
    from_hf = make_trainer(tmp_path / "from_hf", "--checkpoint.initial_load_path", str(exported), steps=1)
    from_dcp = make_trainer(tmp_path / "from_dcp", "--checkpoint.initial_load_path", str(step), steps=1)
    assert_same_weights(full_weights(from_hf), full_weights(from_dcp))
    assert from_hf.train() == from_dcp.train()


# ------------------------------------------------------------------------------------ several processes


def _train_on_ranks(rank: int, world_size: int, dump: str, extra: list[str], steps: int) -> dict:
    """One rank of a trainer run: its losses and the full weights after loading and after training."""
    torch.set_num_threads(1)
    trainer = make_trainer(Path(dump), *extra, steps=steps,
                           dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")))
    start_step, loaded = trainer.step, full_weights(trainer)
    losses = trainer.train()
    trained = full_weights(trainer)
    return {"losses": losses, "start_step": start_step, "loaded": loaded, "trained": trained}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """6 steps of fully_shard on 2 ranks, an async save every 3 steps; returns (folder, losses, weights)."""
    dump = tmp_path_factory.mktemp("two_ranks")
    results = run_on_ranks(_train_on_ranks, 2, args=(str(dump), [
        "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async",
    ], 6))
    return dump, results[0]["losses"], results[0]["trained"]


@pytest.mark.slow
def test_two_ranks_resume_from_async_checkpoint_gives_identical_losses(two_rank_run, tmp_path):
    dump, uninterrupted, _ = two_rank_run
    assert complete_steps(dump / "checkpoint") == [3, 6]
    # As if the job had been killed after step 3: only step-3 exists.
    shutil.copytree(dump / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    resumed = run_on_ranks(_train_on_ranks, 2, args=(str(tmp_path), ["--checkpoint.enable"], 6))
    assert resumed[0]["losses"] == uninterrupted[3:]  # bitwise


@pytest.mark.slow
def test_reshard_fully_shard_two_ranks_to_one_four_tensor_and_pipeline_parallel(two_rank_run, tmp_path, caplog):
    dump, _, saved_weights = two_rank_run
    layouts = {"one_process": (1, []), "fully_shard4": (4, []),
               "tensor_parallel2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
               "pipeline2_interleaved": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"])}
    for name, (ranks, layout) in layouts.items():
        target = tmp_path / name
        shutil.copytree(dump / "checkpoint" / "step-6", target / "checkpoint" / "step-6")
        extra = ["--checkpoint.enable", "--checkpoint.keep_latest_k", "1", *layout]
        if ranks == 1:
            with caplog.at_level(logging.WARNING, logger="titan_simple"):
                trainer = make_trainer(target, *extra, steps=8)
            # Another global batch (1 x the local batch instead of 2 x): the data continues after the samples of
            # the 6 saved steps, exactly, whatever the batch.
            saved_rows = 2 * trainer.config.training.local_batch_size
            assert trainer.dataloader.dataset.consumed == 6 * saved_rows
            assert trainer.step == 6
            assert_same_weights(full_weights(trainer), saved_weights)
            losses = trainer.train()
        else:
            results = run_on_ranks(_train_on_ranks, ranks, args=(str(target), extra, 8))
            assert results[0]["start_step"] == 6
            loaded = {name: w for result in results for name, w in result["loaded"].items()}  # PP: all stages
            assert_same_weights(loaded, saved_weights)
            losses = results[0]["losses"]
        assert len(losses) == 2 and all(0 < loss < 8 for loss in losses), name  # training continues
        assert complete_steps(target / "checkpoint") == [8], name


def test_resuming_with_another_rope_stops_with_the_fix_and_an_initial_load_warns(tmp_path, caplog):
    """A run saved with plain RoPE (as every 8B/70B/405B run was before those flavors became Llama 3.1's) does not
    silently resume with scaled RoPE; ``--model.rope_scaling none`` continues it; starting a new run from it with
    other RoPE (a context extension) is allowed, with a warning."""
    tied = ["--model.flavor", "debugmodel_tied", "--model.n_layers", "1", "--checkpoint.enable"]
    make_trainer(tmp_path, *tied, "--model.rope_scaling", "none", steps=1).train()
    step = tmp_path / "checkpoint" / "step-1"
    marker = json.loads((step / MARKER).read_text())
    marker["model_args"]["rope_scaling"] = False  # as complete.json recorded it before the scaling had parameters
    (step / MARKER).write_text(json.dumps(marker))
    with pytest.raises(ConfigError, match=r"rope_scaling none \(this run: llama3 factor 32, .*--model.rope_scaling "
                                          r"none to continue") as error:
        make_trainer(tmp_path, *tied, steps=2)
    assert "\n" not in str(error.value)
    assert make_trainer(tmp_path, *tied, "--model.rope_scaling", "none", steps=2).step == 1
    with caplog.at_level(logging.WARNING, logger="titan_simple"):
        extended = make_trainer(tmp_path / "extended", "--model.flavor", "debugmodel_tied", "--model.n_layers", "1",
                                "--checkpoint.initial_load_path", str(step), steps=1)
    assert extended.step == 0 and "starting from its weights with this run's settings" in caplog.text
