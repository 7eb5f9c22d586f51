"""The trainer through stages (issue 57, items 3 and 4): a mixture of three sources and three stages (a batch ramp,
a seq_len and mixture change, an annealing stage started by tokens) trained on 1, 2 and 4 processes and on
dp2 x tp2 with the same losses; stopped by SIGTERM and resumed bit for bit; resumed inside a stage on another
layout; planned in two parts; and a changed past stage refused in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_on_ranks
from tests.harness import FP32, ONE_ROW, logged_losses, output_of, read_metrics, train_py
from tests.test_checkpoint import stop_with_sigterm_after
from tests.test_mixture import sources  # noqa: F401 (the fixture)
from titan_simple.config import load_job_config
from titan_simple.trainer.distributed import DistInfo
from titan_simple.trainer.trainer import Trainer

pytestmark = pytest.mark.slow

STEPS = 12
STAGES = ('[{name = "ramp", start_step = 3, global_batch_size = 8}, '
          '{name = "long", start_step = 6, seq_len = 64, mixture_weights = {marks = 0, plays = 1}}, '
          '{name = "anneal", start_tokens = 2600, lr_decay = true}]')
# the stages that have started after 6 steps: the first part of a run planned in two
FIRST_PART = '[{name = "ramp", start_step = 3, global_batch_size = 8}]'


def _job(sources, stages: str = STAGES, steps: int = STEPS) -> tuple[str, ...]:  # noqa: F811
    mixture = ('[{name = "plays", dataset = "shakespeare", weight = 2}, '
               f'{{name = "digits", dataset = "json", dataset_path = "{sources["digits"]}", weight = 1}}, '
               f'{{name = "marks", dataset = "json", dataset_path = "{sources["marks"]}", weight = 1}}]')
    return (*ONE_ROW, "--model.n_layers", "2", *FP32, "--training.steps", str(steps), "--training.global_batch_size",
            "4", "--lr_scheduler.decay_ratio", "none", "--training.mixture", mixture, "--training.stages", stages)


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory) -> Path:  # noqa: F811
    """The 2-process run (dp 2, local batch 2), a checkpoint after steps 5 (inside 'ramp') and 10."""
    folder = tmp_path_factory.mktemp("stages") / "two"
    train_py(*_job(sources), "--training.local_batch_size", "2", "--job.dump_folder", folder, "--checkpoint.enable",
             "--checkpoint.interval", "5", nproc=2)
    return folder


def _assert_same(losses: dict[int, float], expected: dict[int, float], steps: range, bitwise: bool) -> None:
    assert sorted(losses) == list(steps), losses
    for step in steps:
        if bitwise:
            assert losses[step] == expected[step], (step, losses, expected)
        else:
            assert abs(losses[step] / expected[step] - 1) <= 1e-5, (step, losses, expected)


def test_the_stages_train_alike_on_one_two_and_four_processes_and_on_dp2_tp2(sources, reference, tmp_path):  # noqa: F811
    """Every step's loss to fp32 rounding on every layout (the same global samples: the losses of 12 steps of a
    2-block model tell them apart); the table, each stage's start, and the tokens per source are logged."""
    expected = logged_losses(reference)
    layouts = {"one": (1, ("--training.local_batch_size", "4")),
               "dp4": (4, ("--training.local_batch_size", "1")),
               "dp2_tp2": (4, ("--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"))}
    for name, (nproc, extra) in layouts.items():
        proc = train_py(*_job(sources), *extra, "--job.dump_folder", tmp_path / name, nproc=nproc)
        _assert_same(logged_losses(tmp_path / name), expected, range(1, STEPS + 1), bitwise=False)
        output = output_of(proc)
        assert "stage 1 'ramp' starts at step 4, 384 tokens: global batch 8" in output, name
        assert "stage 3 'anneal' starts at step 10, 2,688 tokens" in output and "decays from here" in output
        table_row = ("    long                    7         1,152       8       64             2  "
                     "plays 1, digits 1, marks 0")
        assert table_row in output
    # tokens per source: 2 : 1 : 1 of 4 x 32 for 3 steps, of 8 x 32 for 3, then 1 : 1 : 0 of 8 x 64 for 6
    last = [r for r in read_metrics(reference) if "data_sources/plays/tokens" in r][-1]
    assert last["data_sources/plays/tokens"] == 3 * 64 + 3 * 128 + 6 * 256
    assert last["data_sources/digits/tokens"] == 3 * 32 + 3 * 64 + 6 * 256
    assert last["data_sources/marks/tokens"] == 3 * 32 + 3 * 64
    lrs = [r["lr"] for r in read_metrics(reference) if "lr" in r]
    assert lrs[8] == lrs[5] > lrs[9] > lrs[10] > lrs[11] > 0  # stable through 'long', then the decay


def _train_until_sigterm(rank: int, world_size: int, argv: list[str], stop_at: int | None) -> tuple[int, list[float]]:
    """One rank of an in-process job: train, stopped by a real SIGTERM during step ``stop_at`` (None: to the end);
    (the step it started from, its losses)."""
    torch.set_num_threads(1)
    trainer = Trainer(load_job_config(argv), dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")))
    if stop_at is not None:
        stop_with_sigterm_after(trainer, stop_at)
    start = trainer.global_step
    return start, trainer.train()


def test_sigterm_inside_each_stage_resumes_bit_for_bit_and_another_layout_resumes_inside_a_stage(
        sources, reference, tmp_path):  # noqa: F811
    """2 processes stopped by SIGTERM in each stage (steps 2, 5, 8, 11) and resumed each time: every step's loss is
    the reference's bit for bit. 1 process resumed from the reference's step 5 (inside 'ramp', whose batch it reads
    in 2 microbatches, not 1 of 2 ranks) continues to fp32 rounding."""
    expected = logged_losses(reference)
    argv = [str(a) for a in (*_job(sources), "--training.local_batch_size", "2", "--job.dump_folder",
                             tmp_path / "stopped", "--checkpoint.enable", "--checkpoint.interval", "100")]
    losses = {}
    for stop_at in (2, 5, 8, 11, None):
        start, trained = run_on_ranks(_train_until_sigterm, 2, args=(argv, stop_at))[0]
        assert start == (0 if not losses else max(losses)) and len(trained) == (stop_at or STEPS) - start
        losses.update(zip(range(start + 1, start + len(trained) + 1), trained, strict=True))
    _assert_same(losses, expected, range(1, STEPS + 1), bitwise=True)
    folder = tmp_path / "from_5"
    train_py(*_job(sources), "--training.local_batch_size", "4", "--job.dump_folder", folder,
             "--checkpoint.initial_load_path", reference / "checkpoint" / "step-5",
             "--checkpoint.initial_load_model_only", "false")
    _assert_same(logged_losses(folder), expected, range(6, STEPS + 1), bitwise=False)


def test_a_run_planned_in_two_parts_equals_the_run_planned_whole_and_a_changed_past_stage_is_refused(
        sources, reference, tmp_path):  # noqa: F811
    """6 steps with the stages started by then (and no decay yet: decay_ratio 0), then the whole config resumed
    from step 6: steps 7-12 are the reference's bit for bit. A resume whose 'ramp' has another batch stops in one
    line before training."""
    folder = tmp_path / "parts"
    first = [*_job(sources, FIRST_PART, steps=6)]
    first[first.index("--lr_scheduler.decay_ratio") + 1] = "0"
    common = ("--training.local_batch_size", "2", "--job.dump_folder", folder, "--checkpoint.enable",
              "--checkpoint.interval", "100")
    train_py(*first, *common, nproc=2)
    train_py(*_job(sources), *common, nproc=2)
    _assert_same(logged_losses(folder), logged_losses(reference), range(1, STEPS + 1), bitwise=True)
    changed = _job(sources, STAGES.replace("global_batch_size = 8", "global_batch_size = 12"))
    refused = train_py(*changed, "--training.local_batch_size", "4", "--job.dump_folder", tmp_path / "changed",
                       "--checkpoint.initial_load_path", reference / "checkpoint" / "step-5",
                       "--checkpoint.initial_load_model_only", "false", expect=2)
    errors = [line for line in output_of(refused).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "trained stage 1 with other settings (global_batch_size 8 -> 12)" in errors[0], errors
    assert not (tmp_path / "changed" / "metrics.jsonl").exists()
    # the data position left out of the resume: the stage table says where step 5's data ends, and it continues there
    excluded = train_py(*_job(sources), "--training.local_batch_size", "4", "--job.dump_folder", tmp_path / "excluded",
                        "--checkpoint.initial_load_path", reference / "checkpoint" / "step-5",
                        "--checkpoint.initial_load_model_only", "false", "--checkpoint.exclude_from_loading",
                        "dataloader")
    assert "the stages read 28 samples in 5 steps; the data continues from there, not from sample 0" \
        in output_of(excluded)
    _assert_same(logged_losses(tmp_path / "excluded"), logged_losses(reference), range(6, STEPS + 1), bitwise=False)


def test_the_shipped_debug_recipe_trains_its_mixture_stages_and_annealing(tmp_path):
    """configs/llama3_debug_recipe.toml as the README runs it (2 processes): each stage starts where its table says,
    each stage's tokens per source match its weights to within one sequence per source, the learning rate is at
    its peak until the annealing stage and then decays towards 0, and the loss falls."""
    proc = train_py("--config", "llama3_debug_recipe.toml", "--job.dump_folder", tmp_path, nproc=2)
    output = output_of(proc)
    for line in ("stage 1 'ramp' starts at step 9, 4,096 tokens: global batch 8 (2 accumulation), seq_len 128",
                 "stage 2 'long' starts at step 15, 10,240 tokens: global batch 8 (2 accumulation), seq_len 256",
                 "stage 3 'anneal' starts at step 19, 18,432 tokens"):
        assert line in output, output[-3000:]
    records = {r["step"]: r for r in read_metrics(tmp_path) if "data_sources/plays/tokens" in r}
    ends = {0: (0, 128, (0.7, 0.3)), 8: (128, 128, (0.7, 0.3)), 14: (128, 256, (0.7, 0.3)), 18: (256, 256, (0.3, 0.7)),
            24: None}
    steps = sorted(ends)
    for start, end in itertools.pairwise(steps):
        _, seq_len, weights = ends[start]
        given = [records[end][f"data_sources/{name}/tokens"] - (records[start][f"data_sources/{name}/tokens"]
                 if start else 0) for name in ("plays", "paragraphs")]
        for tokens, weight in zip(given, weights, strict=True):
            assert abs(tokens - weight * sum(given)) <= seq_len, (start, end, given)
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path) if "lr" in r}
    peak = lrs[6]
    assert lrs[18] == peak > lrs[20] > lrs[22] > lrs[24] > 0 and lrs[24] < peak / 10
    losses = logged_losses(tmp_path)
    assert losses[24] < losses[1] - 1.5, losses


def test_the_8b_recipe_plans_the_llama_3_batches_and_lengths():
    """configs/llama3_8b_recipe.toml at 128 processes: 1,024 sequences of 4,096 (4M tokens), 1,024 of 8,192 from
    the first step boundary past 252M tokens, 2,048 from 2.87T, the annealing stage over the final 40M of 15T
    tokens; the mixture's shares as the paper's; every stage's batch divides (8 then 16 accumulation steps)."""
    from titan_simple.core.plan import resolve_plan

    config = load_job_config(["--config", "llama3_8b_recipe.toml", "--model.tokenizer_path",
                              "assets/tokenizer/shakespeare_bpe_2k.json", "--model.flavor", "debugmodel"])
    stages = resolve_plan(config, 128, "cuda").stages
    table = [(s.name, s.global_rows, s.seq_len, s.accumulation_steps) for s in stages.stages]
    assert table == [("start", 1024, 4096, 8), ("8M", 1024, 8192, 8), ("16M", 2048, 8192, 16),
                     ("anneal", 2048, 8192, 16)]
    assert stages.stages[1].start_tokens - 252_000_000 < 1024 * 4096 <= stages.stages[1].start_tokens
    assert 0 <= stages.stages[2].start_tokens - 2_870_000_000_000 < 1024 * 8192
    end = stages.tokens_after(config.training.steps)
    assert 0 <= end - 15e12 < 2048 * 8192 and end - stages.stages[3].start_tokens <= 40e6 + 2048 * 8192
    assert stages.stages[0].weights == (0.5, 0.25, 0.17, 0.08)
    assert stages.decay_start_step == stages.stages[3].start_step


def test_a_compiled_run_compiles_again_at_a_seq_len_stage_and_trains_as_eager(tmp_path):
    """2 processes, compiled, 4 steps: the stage at step 3 doubles seq_len (new shapes: the graphs compile again,
    under the start-up timeout) and ramps the batch; every loss equals the eager run's to fp32 rounding."""
    job = (*ONE_ROW, "--model.n_layers", "1", *FP32, "--training.steps", "4", "--lr_scheduler.decay_ratio", "none",
           "--training.stages", '[{start_step = 2, seq_len = 64, global_batch_size = 4}]')
    compiled = output_of(train_py(*job, "--compile.enable", "--job.dump_folder", tmp_path / "compiled", nproc=2,
                                  timeout=1200))  # the suite's kernel folder: CI keeps it from run to run
    train_py(*job, "--job.dump_folder", tmp_path / "eager", nproc=2)
    _assert_same(logged_losses(tmp_path / "compiled"), logged_losses(tmp_path / "eager"), range(1, 5), bitwise=False)
    assert "stage 1 'stage 1' starts at step 3, 128 tokens: global batch 4 (2 accumulation), seq_len 64" in compiled
    plans = [line for line in compiled.splitlines() if line.startswith("[rank0]") and "comm plan forward" in line]
    assert len(plans) == 2, plans  # the first shapes' graph and the new seq_len's
