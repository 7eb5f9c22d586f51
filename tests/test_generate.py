"""Sampling: a short training run saves a DCP checkpoint (and its Hugging Face export), which is loaded on one
process and continued."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.harness import DEBUG, FOUR_STEPS, NO_TENSORBOARD, REPO, load_script, one_torch_thread, run_script
from titan_simple.config import load_job_config
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.errors import ConfigError
from titan_simple.generate import generate, load_model_for_generation, sample_next_token
from titan_simple.models.attention import AttentionInputs, KVCache
from titan_simple.models.hf_llama import hf_config
from titan_simple.models.llama3 import LLAMA3_FLAVORS, build_model
from titan_simple.models.rope import LLAMA31_ROPE
from titan_simple.trainer.checkpoint import export_hf, load_model_weights
from titan_simple.trainer.trainer import Trainer

STEPS = 4  # FOUR_STEPS's
TINY = (*FOUR_STEPS, *NO_TENSORBOARD, "--checkpoint.enable", "--checkpoint.last_save_in_hf")
PROMPT = "ROMEO:"
GENERATE_PY = REPO / "scripts" / "generate.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, trained model, tokenizer, checkpoint folder) of a 4-step run of the debug model.

    The trainer saves <dump>/checkpoint/step-4 (DCP, weights under "model") and step-4/hf (safetensors).
    """
    dump = tmp_path_factory.mktemp("run")
    config = load_job_config([*TINY, "--job.dump_folder", str(dump)])
    with one_torch_thread():
        trainer = Trainer(config)
        trainer.train()
        assert (dump / "checkpoint" / f"step-{STEPS}" / "hf").is_dir()
        yield config, trainer.run.parts.model, trainer.tokenizer, dump / "checkpoint"


@pytest.fixture(scope="module")
def model(trained):
    config, _, _, checkpoint = trained
    return load_model_for_generation(config, str(checkpoint), max_seq_len=128, device=torch.device("cpu"))


def test_loaded_model_equals_the_trained_one(trained, model):
    _, trained_model, _, _ = trained
    trained_state = trained_model.state_dict()
    loaded_state = model.state_dict()
    assert loaded_state.keys() == trained_state.keys()
    for name, value in trained_state.items():
        assert torch.equal(loaded_state[name], value), name
    tokens = torch.randint(0, 2000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trained_model(tokens), rtol=0, atol=0)


def test_hugging_face_export_generates_the_same_tokens(trained, model):
    config, _, tokenizer, checkpoint = trained
    hf_model = load_model_for_generation(config, str(checkpoint / f"step-{STEPS}" / "hf"), max_seq_len=128,
                                         device=torch.device("cpu"))
    prompt = tokenizer.encode(PROMPT, eos=False)
    from_dcp = generate(model, prompt, 8, temperature=1.0, top_k=50, seed=1)
    from_hf = generate(hf_model, prompt, 8, temperature=1.0, top_k=50, seed=1)
    assert from_hf.tokens == from_dcp.tokens
    torch.testing.assert_close(from_hf.logits, from_dcp.logits, rtol=0, atol=0)  # float32 export: exact


def test_same_seed_same_text_other_seed_other_text(trained, model):
    tokenizer: Tokenizer = trained[2]
    prompt = tokenizer.encode(PROMPT, eos=False)
    runs = [generate(model, prompt, 24, temperature=1.0, top_k=50, seed=seed) for seed in (7, 7, 8)]
    assert len(runs[0].tokens) == 24 and all(0 <= t < tokenizer.vocab_size for t in runs[0].tokens)
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens  # 24 draws from a barely trained model: a tie is ~impossible
    text = tokenizer.decode(runs[0].tokens)
    assert isinstance(text, str) and len(text) > 0
    assert tokenizer.encode(PROMPT + text, bos=False, eos=False)  # the text is ordinary, re-encodable text
    assert runs[0].tokens_per_second > 0


def test_kv_cache_generation_equals_full_recompute(trained, model):
    prompt = trained[2].encode(PROMPT, eos=False)
    cached = generate(model, prompt, 20, temperature=0.0, use_kv_cache=True)
    full = generate(model, prompt, 20, temperature=0.0, use_kv_cache=False)
    assert cached.tokens == full.tokens
    for step, (a, b) in enumerate(zip(cached.logits, full.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"logits of new token {step}")


def test_cache_in_chunks_equals_one_forward():
    """Prompt, then a 3-token chunk, then 1 token: the chunk needs the offset causal mask."""
    torch.manual_seed(0)
    model = build_model("debugmodel", max_seq_len=32, device="cpu").eval()
    tokens = torch.randint(0, 2000, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, batch_size=2, max_len=9, device="cpu", dtype=torch.float32)
        inputs = AttentionInputs(cache=cache)
        pieces = [model(tokens[:, :5], inputs), model(tokens[:, 5:8], inputs), model(tokens[:, 8:], inputs)]
    assert cache.position == 9
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens[:, :1], inputs)


def test_top_k_one_is_greedy_and_temperature_zero_is_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    generator = torch.Generator().manual_seed(0)
    assert all(sample_next_token(logits, 1.5, 1, generator) == 1 for _ in range(20))
    assert sample_next_token(logits, 0.0, None, None) == 1
    assert {sample_next_token(logits, 1.0, 2, generator) for _ in range(200)} == {1, 3}  # only the top 2


def test_script_prints_text_and_speed(trained, model):
    checkpoint = trained[3]
    result = run_script(GENERATE_PY, *DEBUG, "--training.seq_len", "64", "--checkpoint", checkpoint / f"step-{STEPS}",
                        "--prompt", PROMPT, "--max_new_tokens", "12", "--temperature", "0.7", "--top_k", "40",
                        "--seed", "3", timeout=300)
    prompt = trained[2].encode(PROMPT, eos=False)
    expected = generate(model, prompt, 12, temperature=0.7, top_k=40, seed=3, stop_token=trained[2].eos_id)
    assert result.stdout == PROMPT + trained[2].decode(expected.tokens) + "\n"  # the same tokens as in-process
    assert "tokens/s" in result.stderr


def test_script_reports_a_checkpoint_of_another_flavor_in_one_line(trained, capsys):
    code = _generate_script().main([*DEBUG, "--model.flavor", "debugmodel_large", "--checkpoint", str(trained[3]),
                                    "--prompt", PROMPT])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.startswith("error: checkpoint") and stderr.count("\n") == 1, stderr


# ------------------------------------------------------------------ the model a checkpoint records (complete.json)


def _generate_script() -> ModuleType:
    return load_script(GENERATE_PY, "generate_script")


def _train_one_step(dump: Path, *extra: str) -> Path:
    config = load_job_config([*TINY, "--training.steps", "1", "--checkpoint.last_save_in_hf=false",
                              "--job.dump_folder", str(dump), *extra])
    Trainer(config).train()
    return dump / "checkpoint" / "step-1"


@pytest.fixture(scope="module")
def tied_step(tmp_path_factory) -> Path:
    """A one-block debugmodel_tied run's checkpoint (tied embeddings, RoPE scaled 32x)."""
    return _train_one_step(tmp_path_factory.mktemp("tied"), "--model.flavor", "debugmodel_tied",
                           "--model.n_layers", "1")


def test_a_tied_checkpoint_is_refused_by_an_untied_model_naming_the_flavor_it_was_saved_with(tied_step, capsys):
    """It used to load into --model.flavor debugmodel (untied, unscaled RoPE) without a word."""
    code = _generate_script().main(["--config", "llama3_debug.toml", "--model.n_layers", "1", "--checkpoint",
                                    str(tied_step), "--prompt", PROMPT])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint {tied_step} was saved by a model that computes otherwise: ") and \
        "tie_word_embeddings True (this run: False)" in err, err
    assert err.endswith("build the model it was saved by: --model.flavor debugmodel_tied.\n"), err
    with pytest.raises(ConfigError, match=r"tie_word_embeddings True \(this run: False\).*--model.flavor "
                                          r"debugmodel_tied --model.n_layers 1\.$"):  # no config: every key it took
        load_model_weights(str(tied_step), build_model("debugmodel", n_layers=1, device="cpu"))


@pytest.fixture(scope="module")
def hf_config_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder, the checkpoint) of a one-block run built by [model] hf_config from a Llama 3.1-style config.json
    (RoPE scaled 8x) that declares 32768 positions."""
    root = tmp_path_factory.mktemp("hf_config")
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1, rope_scaling=LLAMA31_ROPE)
    folder = root / "llama31"
    folder.mkdir()
    declared = {**hf_config(args, torch.float32), "max_position_embeddings": 32768}
    (folder / "config.json").write_text(json.dumps(declared))
    return folder, _train_one_step(root / "run", "--model.hf_config", str(folder))


def test_a_checkpoint_of_an_hf_config_run_names_that_hf_config_not_the_flavor(hf_config_run, capsys):
    folder, step = hf_config_run
    code = _generate_script().main(["--config", "llama3_debug.toml", "--checkpoint", str(step), "--prompt", PROMPT])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: checkpoint {step} does not match"), err
    assert err.endswith(f"build the model it was saved by: --model.hf_config {folder.resolve()}.\n"), err
    assert "flavor" not in err


def test_a_checkpoint_saved_with_other_rope_warns_as_an_initial_load_does(hf_config_run, tmp_path, caplog):
    """It used to generate with the config's RoPE without a word."""
    folder, step = hf_config_run
    unscaled = tmp_path / "unscaled"
    unscaled.mkdir()
    (unscaled / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                      "rope_scaling": None}))
    config = load_job_config(["--config", "llama3_debug.toml", "--model.hf_config", str(unscaled)])
    with caplog.at_level(logging.WARNING, logger="titan_simple"):
        model = load_model_for_generation(config, str(step), device=torch.device("cpu"))
    assert model.args.rope_scaling is None
    assert (f"checkpoint {step} was saved by a model that computes otherwise: rope_scaling llama3 factor 8, low 1, "
            "high 4, original context 8192 (this run: none): starting from its weights with this run's settings"
            ) in caplog.text


def test_an_hf_config_run_records_its_model_and_exports_the_folders_context(hf_config_run, tmp_path):
    folder, step = hf_config_run
    marker = json.loads((step / "complete.json").read_text())
    assert marker["model"] == {"hf_config": str(folder.resolve()), "flavor": None, "rope_scaling": None,
                               "n_layers": None}
    assert marker["model_args"]["max_position_embeddings"] == 32768
    exported = export_hf(step, tmp_path / "hf")
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 32768
