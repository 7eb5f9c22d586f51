"""Stages (issue 57, item 3): the stage table, its one-line refusals, the learning rate on the tokens' clock, and the
global samples of a run whose batch, seq_len and mixture weights change, the same on every layout. The trainer
across stages, layouts and resumes is ``tests/test_stages_training.py``."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from tests.harness import dry_run, output_of
from tests.test_mixture import SEQ, TOKENIZER, _mixture, _source_of_rows, cache, sources  # noqa: F401 (fixtures)
from titan_simple.config import load_job_config
from titan_simple.core.optim import build_lr_scheduler, lr_scheduler_from_config
from titan_simple.core.plan import resolve_plan
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.staged import check_data_record
from titan_simple.errors import CheckpointError, ConfigError
from titan_simple.models.llama3 import flops_per_token

STAGES = ('[{name = "ramp", start_step = 4, global_batch_size = 16}, '
          '{name = "long", start_tokens = 1500, seq_len = 32, mixture_weights = {marks = 0, digits = 0.5}}, '
          '{name = "anneal", start_step = 19, lr_decay = true}]')


def _config(sources, *extra: str, stages: str = STAGES):  # noqa: F811
    return load_job_config(["--config", "llama3_debug.toml", "--training.seq_len", str(SEQ),
                            "--training.local_batch_size", "2", "--training.global_batch_size", "8",
                            "--training.steps", "30", "--lr_scheduler.decay_ratio", "none",
                            "--training.mixture", _mixture_toml(sources), "--training.stages", stages, *extra])


def _mixture_toml(sources) -> str:  # noqa: F811
    return "[" + ", ".join(f'{{name = "{name}", dataset = "json", dataset_path = "{sources[name]}", weight = {w}}}'
                           for name, w in (("letters", 0.55), ("digits", 0.3), ("marks", 0.15))) + "]"


def test_the_table_places_every_stage_in_steps_tokens_and_samples(sources):  # noqa: F811
    """8 rows of 16 tokens for 4 steps (512 tokens), then 16 rows: 'long' starts at the first step boundary with
    1,500 tokens (step 8's end: 512 + 4 x 256 = 1,536), at 32 tokens a row; dp 2 x local 2 sets accumulation."""
    plan = resolve_plan(_config(sources), 2, "cpu").stages
    table = [(s.name, s.start_step, s.start_tokens, s.start_samples, s.global_rows, s.seq_len, s.accumulation_steps,
              s.weights, s.lr_decay) for s in plan.stages]
    assert table == [
        ("start", 0, 0, 0, 8, 16, 2, (0.55, 0.3, 0.15), False),
        ("ramp", 4, 512, 32, 16, 16, 4, (0.55, 0.3, 0.15), False),
        ("long", 8, 1536, 96, 16, 32, 4, (0.55, 0.5, 0.0), False),
        ("anneal", 19, 1536 + 11 * 512, 96 + 11 * 16, 16, 32, 4, (0.55, 0.5, 0.0), True),
    ]
    assert [plan.at_step(s).name for s in (1, 4, 5, 8, 9, 19, 20, 30)] == [
        "start", "start", "ramp", "ramp", "long", "long", "anneal", "anneal"]
    assert plan.tokens_after(9) == 1536 + 512 and plan.samples_after(9) == 112
    assert [plan.stage_of_sample(g).name for g in (31, 32, 95, 96)] == ["start", "ramp", "ramp", "long"]
    args = resolve_plan(_config(sources), 2, "cpu").model_args
    assert args.max_seq_len == 32  # RoPE as long as the longest
    # TFLOP/s and MFU count each stage's attention at its seq_len: 16 tokens through step 8, then 32
    first = flops_per_token(args, 1000, 16)
    assert plan.flops_per_token(8, first, args) == first
    assert plan.flops_per_token(9, first, args) == flops_per_token(args, 1000, 32) > first


@pytest.mark.parametrize("stages, extra, world, message", [
    ('[{start_step = 3, global_batch_size = 10}]', (), 2,
     "'stage 1': global_batch_size = 10 is not a multiple of local_batch_size x data-parallel degree = 2 x 2"),
    ('[{start_step = 3, seq_len = 18}]', ("--parallelism.context_parallel_degree", "2"), 2,
     "'stage 1': seq_len = 18 is not a multiple of 2 x context_parallel_degree = 4"),
    ('[{start_step = 3, seq_len = 32}]', ("--parallelism.pipeline_parallel_degree", "2"), 2,
     "pipeline parallel infers the shapes its stages send once"),
    ('[{start_step = 3}, {start_step = 3}]', (), 1, "start_step = 3 is not after the previous stage's (3)"),
    ('[{start_step = 9}, {start_tokens = 100}]', (), 1,
     "'stage 2' starts at step 10, not after the stage before it (from step 10)"),
    ('[{start_step = 3, start_tokens = 100}]', (), 1, "set exactly one of start_step or start_tokens"),
    ('[{start_step = 3, mixture_weights = {pages = 1}}]', (), 1, "mixture_weights names 'pages', which is not"),
    ('[{start_step = 3, mixture_weights = {letters = 0, digits = 0, marks = 0}}]', (), 1,
     "leave no source with a positive weight"),
    ('[{start_step = 3, lr_decay = true}, {start_step = 5, lr_decay = true}]', (), 1, "the decay starts once"),
    ('[{start_step = 3, lr_decay = true}]', ("--lr_scheduler.decay_ratio", "0.2"), 1,
     "remove decay_ratio from the file (or --lr_scheduler.decay_ratio none)"),
    ('[{start_step = 3, seq_len = 0}]', (), 1, "seq_len = 0 is impossible"),
    ('[{start_step = 3, lr_decay = true}]', (), 1, "lr_decay starts the decay at step 4, inside the warmup"),
    ('[{start_step = 3, sequence_length = 8}]', (), 1, "unknown key 'sequence_length'"),
    ('[{start_step = 3, mixture_weights = 3}]', (), 1, "expected table of str to float"),
])
def test_a_stage_the_run_cannot_take_is_refused_at_plan_time_in_one_line(sources, stages, extra, world,  # noqa: F811
                                                                         message):
    with pytest.raises(ConfigError) as error:
        resolve_plan(_config(sources, *extra, stages=stages), world, "cpu")
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_learning_rate_counts_tokens_and_decays_from_the_stage(sources):  # noqa: F811
    """Until the batch changes the staged schedule gives WarmupStableDecay's values bit for bit; from there a step
    advances the clock by its tokens (2 first-stage steps a step after the ramp, 4 after seq_len doubles); the
    decay runs from 'anneal' to the last step and ends just above the minimum."""
    config = _config(sources, "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_type", "linear",
                     "--lr_scheduler.min_lr_factor", "0")
    plan = resolve_plan(config, 2, "cpu").stages

    def values(scheduler, optimizer, steps):
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    staged_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    staged = values(lr_scheduler_from_config(config, staged_optimizer, plan), staged_optimizer, 30)
    plain_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plain = values(build_lr_scheduler(plain_optimizer, steps=30, warmup_steps=3, decay_ratio=0.0), plain_optimizer, 4)
    assert staged[:4] == plain  # warmup and the first stable step: the same floats
    assert staged[4:19] == [1.0] * 15
    # x after step s: 4 + 2 (s - 4) through step 8 (12), then 12 + 4 (s - 8); decay from x(19) = 56 to x(30) = 100
    x = [4 + 2 * (s - 4) if s <= 8 else 12 + 4 * (s - 8) for s in range(20, 31)]
    assert staged[19:] == pytest.approx([1 - (v - 56) / 45 for v in x], abs=1e-12)
    assert 0 < staged[-1] < 0.1


def _staged_loader(sources, cache, config, dp_rank=0, dp=1):  # noqa: F811
    plan = resolve_plan(config, dp, "cpu")
    local = plan.config.training.local_batch_size
    return build_dataloader(dataset="unused", dataset_path=None, tokenizer=Tokenizer(TOKENIZER), seq_len=SEQ,
                            local_batch_size=local, dp_rank=dp_rank, dp_world_size=dp, shuffle_seed=7, cache=cache,
                            mixture=plan.config.training.mixture, stages=plan.stages)


def _global_batches(sources, cache, dp: int, steps: int, resume_at: int = 0):  # noqa: F811
    """Each step's global batch as dp ranks read it (each rank its accumulation's microbatches, in order)."""
    config = _config(sources, "--training.local_batch_size", str(8 // dp))
    plan = resolve_plan(config, dp, "cpu").stages
    loaders = [_staged_loader(sources, cache, config, r, dp) for r in range(dp)]
    for loader in loaders:
        loader.dataset.resume_at(resume_at)
    iterators = [iter(loader) for loader in loaders]
    first = next(s for s in range(steps + 1) if plan.samples_after(s) == resume_at)
    out = []
    for step in range(first + 1, first + steps + 1):
        accumulation = plan.at_step(step).accumulation_steps
        out.append(np.concatenate([np.concatenate([next(it)[0].numpy() for _ in range(accumulation)])
                                   for it in iterators]))
    return out


def test_every_layout_reads_the_same_samples_through_the_stages_and_each_stage_keeps_its_shares(sources, cache):  # noqa: F811
    """dp 1, 2, 4 (local batch 8, 4, 2: accumulation 1 then 2, 2 then 4, 4 then 8): the same global batches
    through a batch ramp, a seq_len change and a mixture change; each stage's rows by source match its shares
    to within one sequence per source; a loader resumed inside 'long' continues as the uninterrupted one."""
    steps = 24
    one = _global_batches(sources, cache, 1, steps)
    for dp in (2, 4):
        assert all(np.array_equal(a, b) for a, b in zip(_global_batches(sources, cache, dp, steps), one, strict=True))
    assert [b.shape for b in one[:5]] == [(8, 16)] * 4 + [(16, 16)] and one[8].shape == (16, 32)
    config = _config(sources, "--training.local_batch_size", "8")
    index = _staged_loader(sources, cache, config).dataset.index
    plan = index.plan
    for stage, blend, (start, end) in zip(plan.stages[:3], index.blends[:3], ((0, 4), (4, 8), (8, 19)), strict=True):
        counts = dict.fromkeys(("letters", "digits", "marks"), 0)
        for rows in one[start:end]:
            for name in _source_of_rows(blend, rows):
                counts[name] += 1
        total, weights = sum(counts.values()), dict(zip(counts, stage.weights, strict=True))
        for name, count in counts.items():
            assert abs(count - total * weights[name] / sum(stage.weights)) <= 1, (stage.name, counts)
    assert index.taken(plan.samples_after(19))[2] == index.taken(96)[2]  # marks left out from 'long' on
    resumed = _global_batches(sources, cache, 1, steps - 10, resume_at=plan.samples_after(10))
    assert all(np.array_equal(a, b) for a, b in zip(resumed, one[10:], strict=True))


def test_a_source_continues_after_its_tokens_when_the_window_changes(sources, cache):  # noqa: F811
    """At 'long' each source starts at its position in windows of 33 tokens: its samples of 17 tokens so far,
    rounded up; per-source tokens add the stages' seq_lens."""
    index = _staged_loader(sources, cache, _config(sources)).dataset.index
    before = index.blends[1].positions(96 - 32)
    assert index.blends[2].offsets == [math.ceil(p * 17 / 33) for p in before]
    tokens = {name: t for name, t, _ in index.progress(96 + 16)}
    taken_long = index.blends[2].taken(16)
    assert tokens["letters"] == index.taken(96)[0] * 16 + taken_long[0] * 32
    record = index.record(96 + 16)
    assert [s["seq_len"] for s in record["stages"]] == [16, 16, 32]
    with pytest.raises(CheckpointError, match="trained stage 1 with other settings .global_batch_size 16 -> 24"):
        changed = _config(sources, stages=STAGES.replace("global_batch_size = 16", "global_batch_size = 24"))
        _staged_loader(sources, cache, changed).dataset.index.check_resume("step-9", record, 96 + 16, 9)
    # the stages dropped: the run would go back to the first stage's batch and seq_len
    with pytest.raises(CheckpointError, match=r"is in stage 2 \(global batch 16, seq_len 32\), and this config has no"):
        check_data_record("step-9", {**record, "shares": []}, None, {"consumed_samples": 96 + 16, "seq_len": 16},
                          9)  # one dataset, staged
    index = _staged_loader(sources, cache, _config(sources)).dataset.index
    # saved by a run without stages whose steps this config says ran in 'ramp': refused
    with pytest.raises(CheckpointError, match="was trained without stages, and this config's stage 'ramp' starts"):
        check_data_record("step-6", {"shares": record["shares"]}, index, {"consumed_samples": 48, "seq_len": 16}, 6)
    # another first seq_len: the windows would not continue
    with pytest.raises(CheckpointError, match="trained with .training. seq_len 32, this run's first stage has 16"):
        check_data_record("step-3", record, index, {"consumed_samples": 24, "seq_len": 32}, 3)
    check_data_record("step-3", {"shares": record["shares"]}, index, {"consumed_samples": 24, "seq_len": 16}, 3)
    # a later stage added (a run planned in parts) continues; the stages after the position do not matter
    later = _config(sources, stages=STAGES.replace("start_step = 19", "start_step = 25"))
    _staged_loader(sources, cache, later).dataset.index.check_resume("step-9", record, 96 + 16, 9)


def test_stage_loaders_stay_in_step_with_their_global_batch(sources, cache):  # noqa: F811
    """The rows of one rank across a ramp: its block of each global batch, its microbatches in order."""
    config = _config(sources, "--training.local_batch_size", "2")
    loader = _staged_loader(sources, cache, config, dp_rank=1, dp=2)
    batches = list(itertools.islice(loader, 2 * 4 + 4 * 2))  # 4 steps of 2 microbatches, then 2 steps of 4
    one = _global_batches(sources, cache, 1, 6)
    assert np.array_equal(np.concatenate([b[0].numpy() for b in batches[:2]]), one[0][4:8])
    step5 = np.concatenate([b[0].numpy() for b in batches[8:12]])
    assert np.array_equal(step5, one[4][8:16])


def test_the_dry_run_prices_every_stage_and_names_the_one_that_fits_worst(tmp_path):
    """The debug recipe planned for 2 H100s: a row per stage; the ramp doubles the step's time (twice the
    microbatches, the same activations), seq_len 256 keeps more activations than 128; the worst is named."""
    proc, report = dry_run(tmp_path, "--config", "llama3_debug_recipe.toml", "--dry_run.world_size", "2",
                           "--dry_run.device", "h100")
    assert proc.returncode == 0 and report is not None, output_of(proc)[-3000:]
    rows = {r["name"]: r for r in report["stages"]["rows"]}
    assert list(rows) == ["start", "ramp", "long", "anneal"]
    assert [(r["from_step"], r["global_batch"], r["seq_len"]) for r in rows.values()] == [
        (1, 4, 128), (9, 8, 128), (15, 8, 256), (19, 8, 256)]
    assert rows["start"]["device_bytes"] == report["memory_bytes"]["device_total"]  # stage 0 is the report itself
    assert rows["ramp"]["step_seconds"] == pytest.approx(2 * rows["start"]["step_seconds"], rel=0.1)
    assert rows["long"]["device_bytes"] > rows["ramp"]["device_bytes"] and rows["anneal"] == {**rows["long"],
                                                                                              "name": "anneal",
                                                                                              "from_step": 19}
    assert report["stages"]["worst"] == "long" and report["stages"]["all_fit"]
    assert "  the stage that fits worst: long (" in output_of(proc)


def test_a_source_starting_again_is_said_once_across_stages(sources, cache, caplog):  # noqa: F811
    """'marks' (2 documents) starts new epochs in every stage; each epoch is logged once, not again at a stage's
    start (each stage's blend shares what was said)."""
    import logging

    stages = ('[{start_step = 4, global_batch_size = 16}, {start_step = 40, seq_len = 32}, '
              '{start_step = 80, mixture_weights = {marks = 2}}]')
    index = _staged_loader(sources, cache, _config(sources, stages=stages)).dataset.index
    with caplog.at_level(logging.INFO, logger="titan_simple.data.mixture"):
        for consumed in range(0, index.plan.samples_after(120), 8):
            index.say_new_epochs(consumed)
    said = [r.getMessage() for r in caplog.records if "'marks'" in r.getMessage()]
    epochs = [int(message.split("epoch ")[1].split()[0]) for message in said]
    assert len(said) >= 3 and epochs == sorted(set(epochs)), said
