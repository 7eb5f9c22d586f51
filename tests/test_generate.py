"""Sampling: a short training run saves a DCP checkpoint (and its Hugging Face export), which is loaded on one
process and continued."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_simple.config import load_job_config
from titan_simple.data.tokenizer import Tokenizer
from titan_simple.generate import generate, load_model_for_generation, sample_next_token
from titan_simple.models.llama3 import KVCache, build_model
from titan_simple.trainer.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
TINY = ["--config", "llama3_debug.toml", "--training.steps", str(STEPS), "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "2",
        "--metrics.enable_tensorboard=false", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, trained model, tokenizer, checkpoint folder) of a 4-step run of the debug model.

    The trainer saves <dump>/checkpoint/step-4 (DCP, weights under "model") and step-4/hf (safetensors).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only contend
    dump = tmp_path_factory.mktemp("run")
    config = load_job_config([*TINY, "--job.dump_folder", str(dump)])
    trainer = Trainer(config)
    trainer.train()
    assert (dump / "checkpoint" / f"step-{STEPS}" / "hf").is_dir()
    yield config, trainer.model, trainer.tokenizer, dump / "checkpoint"
    torch.set_num_threads(threads)


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
        pieces = [model(tokens[:, :5], cache), model(tokens[:, 5:8], cache), model(tokens[:, 8:], cache)]
    assert cache.position == 9
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens[:, :1], cache)


def test_top_k_one_is_greedy_and_temperature_zero_is_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    generator = torch.Generator().manual_seed(0)
    assert all(sample_next_token(logits, 1.5, 1, generator) == 1 for _ in range(20))
    assert sample_next_token(logits, 0.0, None, None) == 1
    assert {sample_next_token(logits, 1.0, 2, generator) for _ in range(200)} == {1, 3}  # only the top 2


def _run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)


def test_script_prints_text_and_speed(trained, model):
    checkpoint = trained[3]
    result = _run_script("--config", "llama3_debug.toml", "--training.seq_len", "64", "--checkpoint",
                         str(checkpoint / f"step-{STEPS}"), "--prompt", PROMPT, "--max_new_tokens", "12",
                         "--temperature", "0.7", "--top_k", "40", "--seed", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    prompt = trained[2].encode(PROMPT, eos=False)
    expected = generate(model, prompt, 12, temperature=0.7, top_k=40, seed=3, stop_token=trained[2].eos_id)
    assert result.stdout == PROMPT + trained[2].decode(expected.tokens) + "\n"  # the same tokens as in-process
    assert "tokens/s" in result.stderr


def test_script_reports_a_checkpoint_of_another_flavor_in_one_line(trained, capsys):
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--config", "llama3_debug.toml", "--model.flavor", "debugmodel_large", "--checkpoint",
                        str(trained[3]), "--prompt", PROMPT])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.startswith("error: checkpoint") and stderr.count("\n") == 1, stderr
