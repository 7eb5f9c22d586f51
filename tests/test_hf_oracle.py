"""Hugging Face ``transformers`` as the oracle for our model and its checkpoints: an implementation none of us wrote.

Every model here is built locally from a ``LlamaConfig`` (nothing comes from the Hub). Logits are compared in fp32
as ``max |ours - theirs| / max |theirs|`` at 128 and 4,096 tokens, where RoPE scaling matters (the debug models'
slowest rotations have wavelengths of thousands of positions).

* **Export**: the debug model and its Llama 3.2-shaped twin (tied embeddings, RoPE scaled 32x), trained a step and
  exported by the trainer, load in ``LlamaForCausalLM`` with the same logits.
* **Import**: folders that ``transformers`` writes (Llama 3.1 scaling, Llama 3.2 scaling with tying, a non-default
  theta and epsilon) load through every documented route -- the trainer's ``initial_load_path``,
  ``scripts/generate.py`` and the Python loader -- with ``[model] hf_config`` naming the folder.
* **Refusal**: a folder whose config.json computes another function than the chosen flavor stops ``train.py``
  with one line naming the field and the fix, exit 2, before anything is written.

``transformers`` is in the ``dev`` extra: without it these tests fail (an import error), they do not skip.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import train
from tests.harness import REPO, SMALL, load_script
from titan_simple.config import load_job_config
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError
from titan_simple.generate import load_model_for_generation
from titan_simple.models.hf_llama import model_args_from_hf, read_hf_config, save_hf
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer, build_model
from titan_simple.models.rope import LLAMA31_ROPE
from titan_simple.trainer.checkpoint import load_model_weights
from titan_simple.trainer.trainer import Trainer

LENGTHS = (128, 4096)
RTOL = 1e-4  # max |d| / max |logit|; measured: about 3e-7 (fp32, different kernels and summation orders)
# The folders' shapes and RoPE settings are scripts/benchmarks/hf_oracle_check.py's (the same comparison as a table).
ORACLE_CHECK = load_script("scripts/benchmarks/hf_oracle_check.py")
HF_SHAPE = ORACLE_CHECK.SHAPE  # a debug-sized Llama in transformers' terms (2 blocks, the debug model's widths)
LLAMA3_SCALING = ORACLE_CHECK.SCALING
HF_FOLDERS = dict(zip(("llama3.1_scaling", "llama3.2_scaling_tied", "theta_1e4"), ORACLE_CHECK.FOLDERS.values(),
                      strict=True))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokens() -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {n: torch.randint(0, 2000, (1, n), generator=generator) for n in LENGTHS}


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@torch.no_grad()
def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def hf_model(folder: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa", dtype=torch.float32).eval()


def assert_matches_oracle(ours: torch.nn.Module, theirs: LlamaForCausalLM, tokens: dict[int, torch.Tensor]) -> None:
    for n, ids in tokens.items():
        error = relative_error(logits_of(ours, ids), logits_of(theirs, ids))
        assert error <= RTOL, (n, error)


# ------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_exported_model_computes_in_transformers_what_it_computes_here(flavor, tmp_path, tokens):
    config = load_job_config([*SMALL, "--model.flavor", flavor, "--training.steps", "1", "--job.dump_folder",
                              str(tmp_path), "--checkpoint.enable", "--checkpoint.last_save_in_hf"])
    trainer = Trainer(config)
    trainer.train()
    step = tmp_path / "checkpoint" / "step-1"
    exported = json.loads((step / "hf" / "config.json").read_text())
    tokenizer = trainer.tokenizer
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    args = LLAMA3_FLAVORS[flavor]
    assert exported["tie_word_embeddings"] is args.tie_word_embeddings
    if args.rope_scaling is not None:
        assert exported["rope_scaling"] == {**LLAMA3_SCALING, "factor": args.rope_scaling.factor}
        assert exported["max_position_embeddings"] > args.rope_scaling.original_context
    else:
        assert exported["rope_scaling"] is None

    ours = load_model_for_generation(config, str(step), max_seq_len=max(LENGTHS), device=torch.device("cpu"),
                                     dtype=torch.float32)
    assert_matches_oracle(ours, hf_model(step / "hf"), tokens)


def test_the_oracle_tells_a_dropped_rope_scaling(tmp_path, tokens):
    """The tolerance is far below what losing the scaling costs: the test above can fail."""
    model = build_model("debugmodel_tied", max_seq_len=max(LENGTHS), device="cpu")
    save_hf(model.state_dict(), model.args, tmp_path)
    theirs = hf_model(tmp_path)
    unscaled = Transformer(dataclasses.replace(model.args, rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    assert relative_error(logits_of(unscaled, tokens[4096]), logits_of(theirs, tokens[4096])) > 10 * RTOL  # 1.5e-3


# ------------------------------------------------------------------------------------------ import


@pytest.fixture(scope="module", params=list(HF_FOLDERS))
def hf_folder(request, tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    """A folder written by transformers' ``save_pretrained``, weights drawn large enough (std 0.2) for attention
    to depend on position."""
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_SHAPE, **HF_FOLDERS[request.param], initializer_range=0.2)).eval()
    model.save_pretrained(str(folder))
    return folder, model


def test_python_loader_imports_a_transformers_folder(hf_folder, tokens):
    folder, theirs = hf_folder
    args = model_args_from_hf(read_hf_config(folder), str(folder), max_seq_len=max(LENGTHS))
    with torch.device("meta"):
        ours = Transformer(args)
    ours.to_empty(device="cpu")
    ours.init_weights(buffer_device="cpu")
    load_model_weights(str(folder), ours)
    assert_matches_oracle(ours.eval(), theirs, tokens)


def test_generation_loader_imports_a_transformers_folder(hf_folder, tokens):
    folder, theirs = hf_folder
    config = load_job_config(["--config", "llama3_debug.toml", "--model.hf_config", str(folder)])
    ours = load_model_for_generation(config, str(folder), max_seq_len=max(LENGTHS), device=torch.device("cpu"),
                                     dtype=torch.float32)
    assert_matches_oracle(ours, theirs, tokens)


def test_trainer_initial_load_imports_a_transformers_folder(hf_folder, tokens, tmp_path):
    folder, theirs = hf_folder
    config = load_job_config([*SMALL, "--training.seq_len", str(max(LENGTHS)), "--training.steps", "1",
                              "--model.hf_config", str(folder), "--checkpoint.initial_load_path", str(folder),
                              "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(config)
    assert trainer.global_step == 0
    assert_matches_oracle(trainer.run.parts.model.eval(), theirs, tokens)


def test_generate_script_continues_a_prompt_as_transformers_does(hf_folder, capsys):
    folder, theirs = hf_folder
    script = load_script("scripts/generate.py", "generate_script")
    tokenizer = Tokenizer(str(REPO / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"))
    prompt = "ROMEO:"
    code = script.main(["--config", "llama3_debug.toml", "--model.hf_config", str(folder), "--checkpoint",
                        str(folder), "--prompt", prompt, "--max_new_tokens", "12", "--temperature", "0"])
    assert code == 0, capsys.readouterr().err
    ids = torch.tensor([tokenizer.encode(prompt, eos=False)])
    with torch.no_grad():
        greedy = theirs.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_id,
                                 pad_token_id=tokenizer.eos_id)
    new = [t for t in greedy[0, ids.shape[1]:].tolist() if t != tokenizer.eos_id]
    assert capsys.readouterr().out == prompt + tokenizer.decode(new) + "\n"


# ------------------------------------------------------------------------------------------ refusal


MISMATCHES = {  # config.json key -> a value the debug model does not have
    "num_hidden_layers": 5,
    "vocab_size": 4000,
    "rope_theta": 10000.0,
    "rope_scaling": {**LLAMA3_SCALING, "factor": 8.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def debug_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("debug_hf")
    model = build_model("debugmodel", device="cpu")
    save_hf(model.state_dict(), model.args, folder)
    return folder


@pytest.mark.parametrize("key", list(MISMATCHES))
def test_a_folder_that_does_not_fit_the_flavor_stops_before_anything(key, debug_folder, tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    for file in debug_folder.iterdir():
        os.symlink(file, folder / file.name)
    hf = json.loads((debug_folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**hf, key: MISMATCHES[key]}))
    dump = tmp_path / "dump"
    code = train.main([*SMALL, "--training.steps", "1", "--checkpoint.initial_load_path", str(folder),
                       "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: Hugging Face weights"), err
    assert f"{key} " in err and "(flavor debugmodel:" in err and f"hf_config = '{folder}'" in err, err
    assert not dump.exists()  # nothing trained or written

    config = load_job_config(["--config", "llama3_debug.toml"])
    with pytest.raises(ConfigError, match=f"{key} "):
        load_model_for_generation(config, str(folder), device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=f"{key} "):
        load_model_weights(str(folder), build_model("debugmodel", device="cpu"))


def test_a_folder_of_another_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF_SHAPE, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="'mistral' model; titan_simple builds Llama only"):
        model_args_from_hf(read_hf_config(tmp_path), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**HF_SHAPE, "rope_scaling": {"rope_type": "yarn",
                                                                                   "factor": 4.0}}))
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not Llama 3's"):
        model_args_from_hf(read_hf_config(tmp_path), str(tmp_path))


def test_llama31_flavors_scale_rope_and_a_folder_names_its_matching_flavor(tmp_path):
    for flavor in ("8B", "70B", "405B"):
        assert LLAMA3_FLAVORS[flavor].rope_scaling == LLAMA31_ROPE
    assert LLAMA3_FLAVORS["debugmodel"].rope_scaling is None
    # A Llama 3.0-style folder of the debug model's shape read against the tied flavor names the flavor it fits.
    model = build_model("debugmodel", device="cpu")
    save_hf(model.state_dict(), model.args, tmp_path)
    config = load_job_config(["--config", "llama3_debug.toml", "--model.flavor", "debugmodel_tied"])
    with pytest.raises(ConfigError, match=r"or choose \[model\] flavor 'debugmodel'"):
        load_model_for_generation(config, str(tmp_path), device=torch.device("cpu"))


def test_a_missing_hf_config_is_one_line(tmp_path, capsys):
    code = train.main([*SMALL, "--model.hf_config", str(tmp_path / "nope"), "--job.dump_folder", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "hf_config" in err and "does not exist" in err, err


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory) -> Path:
    """A two-block debugmodel_tied export: RoPE scaled 32x, tied embeddings."""
    folder = tmp_path_factory.mktemp("tied_hf")
    model = build_model("debugmodel_tied", n_layers=2, device="cpu")
    save_hf(model.state_dict(), model.args, folder)
    return folder


@pytest.mark.parametrize("override", [("--model.rope_scaling", "none"), ("--model.n_layers", "1")])
def test_an_override_of_hf_config_is_named_as_the_fix_not_hf_config(override, tied_folder, tmp_path, capsys):
    """With [model] hf_config already naming the folder, the fix used to be to set hf_config to it."""
    fix = f"[model] hf_config already names this folder; drop {' '.join(override)} (the override changes its model)."
    dump = tmp_path / "dump"
    code = train.main([*SMALL, "--model.hf_config", str(tied_folder), "--checkpoint.initial_load_path",
                       str(tied_folder), *override, "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.endswith(fix + "\n"), err
    assert "hf_config = '" not in err and not dump.exists()
    config = load_job_config(["--config", "llama3_debug.toml", "--model.hf_config", str(tied_folder), *override])
    with pytest.raises(ConfigError) as error:
        load_model_for_generation(config, str(tied_folder), device=torch.device("cpu"))
    assert str(error.value).endswith(fix)
