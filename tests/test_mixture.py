"""A weighted mixture of sources (issue 57, item 1): each source's share of the tokens after any number of steps,
the same global samples on every layout, resume from a position, a source that repeats; the trainer on 1 and 2
processes and resumed across layouts.

The three test sources are written with disjoint alphabets (words of letters, of digits, of punctuation), so that
the tokenizer gives them disjoint token ids and each sample the loader hands out can be traced to its source by its
tokens alone, independently of the mixture's own bookkeeping."""

from __future__ import annotations

import itertools
import json
import logging
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from tests.harness import (
    ONE_ROW,
    REPO,
    load_script,
    logged_losses,
    output_of,
    read_metrics,
    train_py,
)
from titan_simple.config import load_job_config
from titan_simple.config.loading import validate
from titan_simple.config.schema import JobConfig, MixtureSource
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.mixture import MAX_PERIOD, blend_period, exact_shares, period_counts
from titan_simple.errors import ConfigError
from titan_simple.trainer.checkpoint import _unpack
from titan_simple.trainer.metrics import _short_count

TOKENIZER = str(REPO / "assets" / "tokenizer" / "shakespeare_bpe_2k.json")
SEQ = 16
ALPHABETS = {"letters": "abcdefghijklmnopqrstuvwxyz", "digits": "0123456789", "marks": "!?;:"}
# documents per source: the last is smaller than its share, so it repeats (its own epochs)
DOCUMENTS = {"letters": 300, "digits": 60, "marks": 2}
WEIGHTS = {"letters": 0.55, "digits": 0.3, "marks": 0.15}


def _write_sources(folder: Path) -> dict[str, Path]:
    rng, paths = random.Random(0), {}
    for name, alphabet in ALPHABETS.items():
        path = paths[name] = folder / f"{name}.jsonl"
        with path.open("w") as f:
            for _ in range(DOCUMENTS[name]):
                words = ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                         for _ in range(rng.randint(20, 80)))
                f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return _write_sources(tmp_path_factory.mktemp("mixture_sources"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mixture_cache")


def _mixture(sources: dict[str, Path], weights: dict[str, float] = WEIGHTS) -> list:
    toml = ", ".join(f'{{name = "{name}", dataset = "json", dataset_path = "{sources[name]}", weight = {w}}}'
                     for name, w in weights.items())
    return load_job_config(["--config", "llama3_debug.toml", "--training.mixture", f"[{toml}]"]).training.mixture


def _loader(sources, cache, rows: int, dp_rank: int = 0, dp: int = 1, weights=WEIGHTS):
    return build_dataloader(dataset="unused", dataset_path=None, tokenizer=Tokenizer(TOKENIZER), seq_len=SEQ,
                            local_batch_size=rows // dp, dp_rank=dp_rank, dp_world_size=dp, global_rows=rows,
                            shuffle_seed=7, cache=cache, mixture=_mixture(sources, weights))


def _source_of_rows(index, inputs: np.ndarray) -> list[str]:
    """Each row's source, from its tokens: the one source whose store holds every token of the row but the
    special ones the sources share (BOS, EOS)."""
    vocabularies = {s.name: set(np.unique(s.index.store.tokens_between(0, s.index.store.num_tokens)).tolist())
                    for s in index.sources}
    shared = set.intersection(*vocabularies.values())
    names = []
    for row in inputs:
        tokens = set(row.tolist()) - shared
        owners = [name for name, vocabulary in vocabularies.items() if tokens <= vocabulary]
        assert len(owners) == 1, (tokens, owners)
        names.append(owners[0])
    return names


def test_each_sources_tokens_stay_within_one_sequence_of_its_share(sources, cache):
    """8 rows a step; after 50, 200 and 1,000 steps each source gave its share of the tokens to within one
    sequence, counted from the rows the loader handed out; the smallest source has read itself many times."""
    loader = _loader(sources, cache, rows=8)
    index = loader.dataset.index
    counts = dict.fromkeys(WEIGHTS, 0)
    for step, (inputs, _) in enumerate(itertools.islice(loader, 1000), start=1):
        for name in _source_of_rows(index, inputs.numpy()):
            counts[name] += 1
        if step in (50, 200, 1000):
            tokens = step * 8 * SEQ
            for name, weight in WEIGHTS.items():
                assert abs(counts[name] * SEQ - weight * tokens) <= SEQ, (step, name, counts)
            assert index.taken(step * 8) == [counts[name] for name in WEIGHTS], step
    marks = index.sources[2].index
    assert index.epochs(8000)[2] == counts["marks"] / marks.samples_per_epoch > 10  # it repeats


def test_the_blend_keeps_every_prefix_within_one_sample_of_the_shares():
    """Tijdeman's bound, 1 - 1/(2K - 2), over two periods, for random weights of 2 to 6 sources."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        weights = [round(float(w), 3) for w in rng.random(int(rng.integers(2, 7))) ** 3 + 0.001]
        shares = exact_shares(weights)
        order = blend_period(period_counts(shares))
        twice = np.concatenate([order, order])
        n = np.arange(1, len(twice) + 1)
        bound = 1 - Fraction(1, 2 * len(weights) - 2)
        for k, share in enumerate(shares):
            deviation = np.abs(np.cumsum(twice == k) - float(share) * n).max()
            assert deviation <= float(bound) + 1e-9, (weights, k, deviation)


def test_shares_are_exact_fractions_and_an_impractical_period_is_rounded():
    assert exact_shares([0.5, 0.3, 0.2]) == [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]
    assert period_counts(exact_shares([5, 3, 2])) == [5, 3, 2]
    assert period_counts(exact_shares([1, 1, 1])) == [1, 1, 1]
    counts = period_counts(exact_shares([0.123456789, 0.5]))
    assert sum(counts) == MAX_PERIOD and abs(counts[0] / MAX_PERIOD - 0.123456789 / 0.623456789) < 1 / MAX_PERIOD
    # rounded, a tiny share still gets a sample a period: a source with a weight is never dropped
    for weights in ([1, 1e7], [1, 2e6, 2e6]):
        counts = period_counts(exact_shares(weights))
        assert sum(counts) == MAX_PERIOD and counts[0] == 1, (weights, counts)
    assert _short_count(999_600) == "1M" and _short_count(999_499) == "999K" and _short_count(12_345) == "12.3K"


def test_prepare_data_builds_every_source_of_a_mixture_and_training_then_builds_none(sources, tmp_path, capsys):
    entries = (f'{{name = "{n}", dataset = "json", dataset_path = "{sources[n]}"}}' for n in WEIGHTS)
    mixture = "[" + ", ".join(entries) + "]"
    prepare = load_script("scripts/prepare_data.py")
    assert prepare.main(["--config", "llama3_debug.toml", "--training.mixture", mixture,
                         "--training.data_cache", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert all(f"train '{name}':" in printed for name in WEIGHTS), printed
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 3
    config = load_job_config(["--config", "llama3_debug.toml", "--training.mixture", mixture])
    build_dataloader(dataset="unused", dataset_path=None, tokenizer=Tokenizer(TOKENIZER), seq_len=SEQ,
                     local_batch_size=2, dp_rank=0, dp_world_size=1, cache=tmp_path, mixture=config.training.mixture)
    assert sorted(p.name for p in tmp_path.iterdir()) == built  # opened, not built again


def test_a_mixture_set_in_code_is_checked_like_one_from_a_file():
    config = JobConfig()
    config.training.mixture = [MixtureSource(name="a b", dataset_path="x.txt")]
    with pytest.raises(ConfigError, match="name 'a b' must be a word"):
        validate(config)


def test_every_layout_reads_the_same_global_samples_and_resumes_at_a_position(sources, cache):
    """dp 1, 2 and 4 ranks: the rows of each global batch, put together, are the same; a loader started at the
    position after 13 batches continues with batch 14."""
    steps = 30
    one = [inputs for inputs, _ in itertools.islice(_loader(sources, cache, rows=8), steps)]
    for dp in (2, 4):
        ranks = [list(itertools.islice(_loader(sources, cache, rows=8, dp_rank=r, dp=dp), steps)) for r in range(dp)]
        for step in range(steps):
            assert np.array_equal(np.concatenate([ranks[r][step][0].numpy() for r in range(dp)]), one[step].numpy())
    resumed = _loader(sources, cache, rows=8)
    resumed.dataset.resume_at(13 * 8)
    later = [inputs for inputs, _ in itertools.islice(resumed, steps - 13)]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(later, one[13:], strict=True))


def test_a_source_starting_again_is_said_once_per_epoch(sources, cache, caplog):
    index = _loader(sources, cache, rows=8).dataset.index
    marks = index.sources[2].index.samples_per_epoch
    with caplog.at_level(logging.INFO, logger="titan_simple.data.mixture"):
        for consumed in range(0, 1200, 8):
            index.say_new_epochs(consumed)
    said = [r.getMessage() for r in caplog.records if "'marks'" in r.getMessage()]
    expected = index.taken(1192)[2] // marks
    assert len(said) == expected >= 3 and said[0].startswith("data: source 'marks' is in its epoch 2"), said
    assert not [r for r in caplog.records if "'letters'" in r.getMessage()]


@pytest.mark.parametrize("overrides, message", [
    ('[{name = "a", wieght = 1}]', "entry 1: unknown key 'wieght'. Did you mean 'weight'?"),
    ('[{name = "a b"}]', "name 'a b' must be a word"),
    ('[{name = "a"}, {name = "a"}]', "the name(s) a appear twice"),
    ('[{name = "a", weight = 0}]', "'a': weight = 0.0 is impossible"),
    ('[{name = "a", weight = "x"}]', "weight = 'x' has the wrong type; expected float"),
    ("3", "must be tables"),
])
def test_a_wrong_mixture_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_job_config(["--config", "llama3_debug.toml", "--training.mixture", overrides])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_single_dataset_beside_a_mixture_is_refused_unless_the_mixture_replaces_a_files(tmp_path):
    config = tmp_path / "both.toml"
    config.write_text('[training]\ndataset = "text"\n[[training.mixture]]\nname = "a"\ndataset_path = "x.txt"\n')
    with pytest.raises(ConfigError, match=r"dataset is set beside \[\[training.mixture\]\]"):
        load_job_config(["--config", str(config)])
    with pytest.raises(ConfigError, match=r"dataset_path is set beside"):
        load_job_config(["--config", "llama3_debug.toml", "--training.dataset_path", "y.txt",
                         "--training.mixture", '[{name = "a"}]'])
    # the shipped config names shakespeare; a mixture on the command line replaces it
    assert load_job_config(["--config", "llama3_debug.toml", "--training.mixture", '[{name = "a"}]']).training.mixture


@pytest.mark.slow
def test_the_trainer_reads_the_mixture_alike_on_one_and_two_processes_and_resumes_across_them(sources, tmp_path):
    """The built-in corpus and two files, 6 steps of 4 rows: 2 processes (a checkpoint at step 3) and 1 process
    log the same losses to fp32 rounding and the same tokens per source; 1 process resumed from the 2-process
    step 3 logs steps 4-6 as the uninterrupted runs."""
    mixture = ('[{name = "plays", dataset = "shakespeare", weight = 2}, '
               f'{{name = "digits", dataset = "json", dataset_path = "{sources["digits"]}", weight = 1}}, '
               f'{{name = "marks", dataset = "json", dataset_path = "{sources["marks"]}", weight = 1}}]')
    job = (*ONE_ROW, "--model.n_layers", "2", "--training.mixed_precision_param", "float32", "--training.steps", "6",
           "--training.global_batch_size", "4", "--training.mixture", mixture)
    validate = ("--validation.enable", "--validation.freq", "3", "--validation.steps", "2")
    held_out = ('[{name = "plays", dataset = "shakespeare", weight = 2}, '
                f'{{name = "digits", dataset = "json", dataset_path = "{sources["digits"]}", weight = 1}}]')
    two = train_py(*job, "--training.local_batch_size", "2", "--job.dump_folder", tmp_path / "two",
                   "--checkpoint.enable", "--checkpoint.interval", "3", *validate, nproc=2)
    one = train_py(*job, "--training.local_batch_size", "4", "--job.dump_folder", tmp_path / "one", *validate,
                   "--validation.mixture", held_out)
    resumed = train_py(*job, "--training.local_batch_size", "4", "--job.dump_folder", tmp_path / "resumed",
                       "--checkpoint.initial_load_path", tmp_path / "two" / "checkpoint" / "step-3",
                       "--checkpoint.initial_load_model_only", "false")
    losses = {name: logged_losses(tmp_path / name) for name in ("two", "one", "resumed")}
    assert sorted(losses["two"]) == list(range(1, 7)) and sorted(losses["resumed"]) == [4, 5, 6]
    for step, loss in losses["two"].items():
        assert abs(losses["one"][step] / loss - 1) <= 1e-5, (step, losses)
        if step > 3:
            assert abs(losses["resumed"][step] / loss - 1) <= 1e-5, (step, losses)
    # Held-out loss per source: the built-in split's equals the 2-process run's plain validation (the same model
    # and held-out batches), and the mixture's is the sources' weighted 2 : 1.
    for step in (3, 6):
        plain = next(r for r in read_metrics(tmp_path / "two") if r["step"] == step and "validation_metrics/loss" in r)
        mixed = next(r for r in read_metrics(tmp_path / "one") if r["step"] == step and "validation_metrics/loss" in r)
        assert abs(mixed["validation_metrics/plays/loss"] / plain["validation_metrics/loss"] - 1) <= 1e-5, step
        expected = (2 * mixed["validation_metrics/plays/loss"] + mixed["validation_metrics/digits/loss"]) / 3
        assert abs(mixed["validation_metrics/loss"] - expected) <= 1e-12 and "validation_metrics/digits/perplexity" \
            in mixed and "validation_metrics/plays/loss" not in plain
    assert "by source plays " in output_of(one)
    last = {name: [r for r in read_metrics(tmp_path / name) if "data_sources/plays/tokens" in r][-1]
            for name in ("two", "one", "resumed")}
    tokens = {name: {key: value for key, value in record.items() if key.startswith("data_sources/")}
              for name, record in last.items()}
    assert tokens["two"] == tokens["one"] == tokens["resumed"]
    per_step = 4 * 32  # rows x seq_len
    assert tokens["one"]["data_sources/plays/tokens"] == 6 * per_step / 2  # 2 : 1 : 1, 24 rows
    assert tokens["one"]["data_sources/digits/tokens"] == tokens["one"]["data_sources/marks/tokens"] == 6 * per_step / 4
    for output in (output_of(p) for p in (two, one, resumed)):
        assert "mixture of 3 sources by tokens: plays 50.0%" in output
        assert "sources plays " in output and "dataset mixture of plays, digits, marks" in output
    # The checkpoint keeps the mixture and what each source gave (12 samples at step 3: 6, 3, 3) ...
    saved = {"dataloader": {"consumed_samples": 0, "seq_len": 0, "mixture": b""}}
    dcp.load(saved, checkpoint_id=str(tmp_path / "two" / "checkpoint" / "step-3"), no_dist=True)
    record = _unpack(saved["dataloader"]["mixture"])
    assert saved["dataloader"]["consumed_samples"] == 12 and record["taken"] == {"plays": 6, "digits": 3, "marks": 3}
    # ... and a resume that names other shares would not continue: one line, nothing trained
    other = mixture.replace("weight = 2", "weight = 1")
    refused = train_py(*job[:-1], other, "--training.local_batch_size", "4", "--job.dump_folder", tmp_path / "other",
                       "--checkpoint.initial_load_path", tmp_path / "two" / "checkpoint" / "step-3",
                       "--checkpoint.initial_load_model_only", "false", expect=2)
    errors = [line for line in output_of(refused).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "was trained on the mixture plays 1/2, digits 1/4, marks 1/4, this run names the " \
        "mixture plays 1/3" in errors[0] and "--checkpoint.exclude_from_loading dataloader" in errors[0], errors
