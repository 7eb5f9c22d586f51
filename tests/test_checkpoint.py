"""Checkpoints: exact resume (sync and async), atomic folders, keep_latest_k, failures, resharding, HF weights.

The trainer runs in-process on the debug model with a tiny batch (2 x 32 tokens); multi-process runs use
spawned gloo ranks (``run_on_ranks``) so the test can read the full weights back from the ranks and compare
them with what another layout loads.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import train
from tests.distributed_utils import run_on_ranks
from tests.harness import SMALL, load_script
from titan_simple import generate as generation
from titan_simple.config import load_job_config
from titan_simple.core.step import StepHooks
from titan_simple.errors import CheckpointError, ConfigError
from titan_simple.models.from_config import model_args_for
from titan_simple.models.hf_files import INDEX, WEIGHTS
from titan_simple.models.hf_llama import (
    from_hf_name,
    half_split_to_interleaved,
    hf_context,
    interleaved_to_half_split,
    is_hf_folder,
    model_args_from_hf,
    save_hf,
    to_hf_name,
)
from titan_simple.models.llama3 import (
    LLAMA3_FLAVORS,
    ModelArgs,
    Transformer,
    apply_rotary_emb,
    build_model,
    precompute_freqs_cis,
)
from titan_simple.models.rope import LLAMA31_ROPE, LLAMA32_ROPE
from titan_simple.parallel.simple_fsdp import sharded_parameters
from titan_simple.trainer.checkpoint import (
    MARKER,
    complete_steps,
    export_hf,
    find_checkpoint,
    load_model_weights,
)
from titan_simple.trainer.checkpoint_files import (
    commit_step,
    fresh_partial_folder,
    partial_folder,
    single_process_is_fine,
)
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.trainer import Trainer

TINY = (*SMALL, "--lr_scheduler.decay_ratio", "0.5", "--metrics.log_freq", "100")


def make_trainer(dump: Path, *extra: str, steps: int = 6, dist_info: DistInfo | None = None) -> Trainer:
    argv = [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]
    return Trainer(load_job_config(argv), dist_info=dist_info)


def stop_with_sigterm_after(trainer: Trainer, step: int) -> None:
    """Deliver a real SIGTERM during ``step``: the trainer finishes it, saves, and returns."""

    class Sigterm(StepHooks):
        def begin(self) -> None:
            if trainer.global_step == step:
                signal.raise_signal(signal.SIGTERM)

    trainer.run.step.hooks = Sigterm()


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters (all of them unless pipeline parallel), unsharded (a collective)."""
    with sharded_parameters():
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for part in trainer.run.parts.modules for name, p in part.named_parameters()}


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
    assert (resumed.global_step, resumed.tokens_seen) == (2, 2 * 64)
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
    assert again.global_step == 2
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
    with pytest.raises(ConfigError, match=r"does not match the model: .*shape mismatch .*build the model it was saved "
                                          r"by: --model.flavor debugmodel\.$"):
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
    assert seeded.global_step == 0
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


# ------------------------------------------------------------------------ Hugging Face folders: one whole weight set


def tiny_model(seed: int, args: ModelArgs | None = None) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args or tiny_args())


def tiny_step(folder: Path, model: Transformer, choice: dict | None = None) -> Path:
    """A step folder as the trainer commits it (DCP "model" entries and complete.json), without a trainer."""
    fresh_partial_folder(folder, 1)
    with single_process_is_fine():
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(partial_folder(folder, 1)), no_dist=True)
    marker = {"step": 1, "model_only": True, "model_args": dataclasses.asdict(model.args), "special_tokens": {}}
    return commit_step(folder, 1, {**marker, **({"model": choice} if choice else {})})


def loaded_weights(folder: Path, args: ModelArgs | None = None) -> dict[str, torch.Tensor]:
    model = Transformer(args or tiny_args())
    load_model_weights(str(folder), model)
    return dict(model.named_parameters())


def names_in(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def run_export_script(*argv: str) -> int:
    return load_script("scripts/export_hf.py", "export_hf_script").main(list(argv))


def test_an_export_replaces_a_sharded_folders_whole_weight_set_and_keeps_its_other_files(tmp_path, capsys):
    """An export into a folder of shards used to leave them and their index next to the new model.safetensors:
    transformers loaded the new weights, our loader (the index first) silently the old."""
    old, new = tiny_model(0), tiny_model(1)
    folder = tmp_path / "hf"
    save_hf(old.state_dict(), old.args, folder, max_shard_bytes=4096)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1 and (folder / INDEX).is_file()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")

    assert run_export_script("--checkpoint", str(tiny_step(tmp_path / "checkpoint", new)), "--output",
                             str(folder)) == 0, capsys.readouterr().err
    assert names_in(folder) == ["config.json", "model.safetensors", "original", "tokenizer.json"]
    assert (folder / "original" / "params.json").read_text() == "{}"
    assert names_in(tmp_path) == ["checkpoint", "hf"]  # no partial or replaced folder left
    assert_same_weights(loaded_weights(folder), dict(new.named_parameters()))

    save_hf(old.state_dict(), old.args, folder, max_shard_bytes=4096)  # and back to shards: no model.safetensors
    assert WEIGHTS not in names_in(folder) and "tokenizer.json" in names_in(folder)
    assert_same_weights(loaded_weights(folder), dict(old.named_parameters()))


def test_an_export_that_fails_or_was_interrupted_leaves_the_old_folder_whole(tmp_path):
    old, new = tiny_model(0), tiny_model(1)
    folder = tmp_path / "hf"
    save_hf(old.state_dict(), old.args, folder, max_shard_bytes=4096)
    before = {name: (folder / name).read_bytes() for name in names_in(folder)}

    def failing():  # the disk fills after the first tensor
        yield next(iter(new.state_dict().items()))
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ConfigError, match=r"export into .*hf failed \(No space left on device\); the folder is as it "
                                          "was"):
        save_hf(failing(), new.args, folder)
    assert {name: (folder / name).read_bytes() for name in names_in(folder)} == before
    assert names_in(tmp_path) == ["hf"]

    # Killed between its two renames: the old folder is under .hf.export-replaced, the next export puts it back.
    (folder / "tokenizer.json").write_text("{}")
    folder.rename(tmp_path / ".hf.export-replaced")
    save_hf(new.state_dict(), new.args, folder)
    assert names_in(folder) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert names_in(tmp_path) == ["hf"]

    # A folder holding something else than Hugging Face weights is not swapped away; a folder that cannot be
    # renamed (a mount point) is one line, the folder untouched.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds files but no Hugging Face weights"):
        save_hf(new.state_dict(), new.args, other)
    rename = Path.rename

    def busy(self, target):  # a mount point: renaming the folder itself fails
        if self == folder:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return rename(self, target)

    before = {name: (folder / name).read_bytes() for name in names_in(folder)}
    Path.rename = busy
    try:
        with pytest.raises(ConfigError, match=r"failed \(Device or resource busy\); the folder is as it was"):
            save_hf(old.state_dict(), old.args, folder)
    finally:
        Path.rename = rename
    assert {name: (folder / name).read_bytes() for name in names_in(folder)} == before
    assert names_in(tmp_path) == ["hf", "notes"]


def test_an_export_refuses_a_file_a_dcp_checkpoint_and_a_folder_holding_its_source(tmp_path, capsys):
    model = tiny_model(0)
    step = tiny_step(tmp_path / "run" / "checkpoint", model)
    file = tmp_path / "file"
    file.write_text("keep")
    for output, problem in ((file, "is a file"), (step, "holds a DCP checkpoint"),
                            (step.parent, "holds a DCP checkpoint"), (tmp_path / "run", "holds the checkpoint")):
        assert run_export_script("--checkpoint", str(step), "--output", str(output)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: Hugging Face export target") and err.count("\n") == 1, err
        assert problem in err, err
    assert file.read_text() == "keep"
    assert_same_weights(loaded_weights(step), dict(model.named_parameters()))  # untouched
    # --flavor is for a folder without complete.json: naming another model is refused, and the fix is the script's
    assert run_export_script("--checkpoint", str(step), "--output", str(tmp_path / "hf"), "--flavor", "debugmodel") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {step} was saved by a model that computes otherwise") and err.count(
        "\n") == 1
    assert err.rstrip().endswith("(scripts/export_hf.py: leave --flavor out; --flavor is for a DCP folder without "
                                 "complete.json).") and not (tmp_path / "hf").exists()


def test_the_loader_refuses_a_folder_of_two_weight_sets_or_a_set_that_is_not_whole(tmp_path):
    old, new = tiny_model(0), tiny_model(1)
    folder = tmp_path / "hf"
    save_hf(old.state_dict(), old.args, folder, max_shard_bytes=4096)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))

    shutil.copy(save_hf(new.state_dict(), new.args, tmp_path / "new") / WEIGHTS, folder)  # as exports used to leave it
    with pytest.raises(ConfigError, match=rf"^Hugging Face weights {folder} hold two weight sets: {WEIGHTS} besides "
                                          rf"the shards {INDEX} lists; delete the stale set's files") as error:
        load_model_weights(str(folder), Transformer(tiny_args()))
    assert "\n" not in str(error.value)
    (folder / WEIGHTS).unlink()

    shutil.copy(folder / shards[0], folder / "model-00001-of-00099.safetensors")  # a shard of another set
    with pytest.raises(ConfigError, match=r"hold two weight sets: model-00001-of-00099.safetensors besides"):
        load_model_weights(str(folder), Transformer(tiny_args()))
    (folder / "model-00001-of-00099.safetensors").unlink()

    (folder / INDEX).rename(tmp_path / "index")
    with pytest.raises(ConfigError, match=rf"model-00001-of-.* without {INDEX} or {WEIGHTS}; copy the index in"):
        load_model_weights(str(folder), Transformer(tiny_args()))
    (tmp_path / "index").rename(folder / INDEX)
    assert_same_weights(loaded_weights(folder), dict(old.named_parameters()))


def test_a_folder_without_safetensors_or_with_a_broken_file_fails_in_one_line_before_a_model_is_built(
        tmp_path, capsys, monkeypatch):
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1)
    good = save_hf(tiny_model(0, args).state_dict(), args, tmp_path / "good", max_shard_bytes=2_000_000)
    shard = sorted(good.glob("model-*.safetensors"))[1].name
    folders = {name: shutil.copytree(good, tmp_path / name) for name in ("bin", "truncated", "missing")}
    for file in folders["bin"].glob("*.safetensors*"):
        file.unlink()
    torch.save({}, folders["bin"] / "pytorch_model.bin")
    (folders["truncated"] / shard).write_bytes((good / shard).read_bytes()[:-100])
    (folders["missing"] / shard).unlink()
    messages = {
        "bin": f"{folders['bin']} is a Hugging Face folder without safetensors (pytorch_model.bin); titan_simple reads "
               f"safetensors only. Convert it with transformers: LlamaForCausalLM.from_pretrained(",
        "truncated": "the file is truncated or corrupt: download or export it again.",
        "missing": f"{INDEX} lists {shard}, which the folder lacks",
    }
    config = load_job_config([*TINY, "--model.n_layers", "1"])
    monkeypatch.setattr(generation, "Transformer", None)  # building the model would fail: it must not be reached
    for name, folder in folders.items():
        dump = tmp_path / f"dump_{name}"
        code = train.main([*TINY, "--model.n_layers", "1", "--training.steps", "1", "--checkpoint.initial_load_path",
                           str(folder), "--job.dump_folder", str(dump)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and messages[name] in err, err
        assert not dump.exists()  # refused while the plan was made: nothing built, nothing written
        with pytest.raises(ConfigError, match=re.escape(messages[name])):
            load_model_weights(str(folder), Transformer(args))
        with pytest.raises(ConfigError, match=re.escape(messages[name])):
            generation.load_model_for_generation(config, str(folder), device=torch.device("cpu"))


def test_exports_write_metas_context_or_the_imported_one_and_honour_or_refuse_max_seq_len(tmp_path, capsys):
    """max_position_embeddings used to be factor x 8192: 65536 for a Llama 3.1 model, 262144 for a 3.2 one; Meta
    writes 131072 for both. A folder's own value, imported with it, is written back."""
    for rope in (LLAMA31_ROPE, LLAMA32_ROPE):
        args = dataclasses.replace(tiny_args(), rope_scaling=rope)
        written = save_hf(tiny_model(0, args).state_dict(), args, tmp_path / f"x{rope.factor:g}")
        assert json.loads((written / "config.json").read_text())["max_position_embeddings"] == 131072
    folder_config = {**json.loads((tmp_path / "x8" / "config.json").read_text()), "max_position_embeddings": 32768}
    imported = model_args_from_hf(folder_config, "a Llama 3.1 folder", max_seq_len=8)
    plain = dataclasses.replace(imported, max_position_embeddings=None)
    assert imported.max_position_embeddings == 32768
    assert imported == plain and repr(imported) == repr(plain)  # computes the same, fingerprints the same
    step = tiny_step(tmp_path / "checkpoint", tiny_model(0, imported))  # complete.json carries it
    for extra, written in (((), 32768), (("--max_seq_len", "20000"), 20000)):
        assert run_export_script("--checkpoint", str(step), "--output", str(tmp_path / "out"), *extra) == 0
        assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == written
    # trained longer than the folder declares: the trained length; the folder's value once the RoPE is another
    assert hf_context(dataclasses.replace(imported, max_seq_len=65536)) == 65536
    config = load_job_config(["--model.hf_config", str(tmp_path / "x8"), "--model.rope_scaling", "none"])
    assert model_args_for(config).max_position_embeddings is None
    assert run_export_script("--checkpoint", str(step), "--output", str(tmp_path / "out"), "--max_seq_len", "1000") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max_seq_len 1000: the model's RoPE is scaled from an original context of " \
        "8192, and transformers needs max_position_embeddings above it; pass more than 8192" in err, err


# ------------------------------------------------------------------------------------ several processes


def _train_on_ranks(rank: int, world_size: int, dump: str, extra: list[str], steps: int) -> dict:
    """One rank of a trainer run: its losses and the full weights after loading and after training."""
    torch.set_num_threads(1)
    trainer = make_trainer(Path(dump), *extra, steps=steps,
                           dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")))
    start_step, loaded = trainer.global_step, full_weights(trainer)
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
            assert trainer.global_step == 6
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
    assert make_trainer(tmp_path, *tied, "--model.rope_scaling", "none", steps=2).global_step == 1
    with caplog.at_level(logging.WARNING, logger="titan_simple"):
        extended = make_trainer(tmp_path / "extended", "--model.flavor", "debugmodel_tied", "--model.n_layers", "1",
                                "--checkpoint.initial_load_path", str(step), steps=1)
    assert extended.global_step == 0 and "starting from its weights with this run's settings" in caplog.text
