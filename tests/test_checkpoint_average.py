"""Checkpoint averaging (issue 57, item 5): the elementwise mean of three saves of a 2-process run, which loads,
trains on and exports like any step folder; inputs of another run or model refused in one line; the script's
memory against one copy of the model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness import FP32, ONE_ROW, logged_losses, run_python, train_py
from titan_simple.errors import ConfigError
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer
from titan_simple.trainer.checkpoint_average import average_checkpoints
from titan_simple.trainer.checkpoint_files import export_hf, load_model_weights

JOB = (*ONE_ROW, "--model.n_layers", "2", *FP32, "--training.steps", "6")
ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """A 2-process run's checkpoint folder with saves at steps 2, 4 and 6."""
    dump = tmp_path_factory.mktemp("average") / "run"
    train_py(*JOB, "--job.dump_folder", dump, "--checkpoint.enable", "--checkpoint.interval", "2", nproc=2)
    return dump / "checkpoint"


def _weights(folder) -> dict[str, torch.Tensor]:
    model = Transformer(ARGS)
    load_model_weights(folder, model)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_the_average_is_the_elementwise_mean_and_loads_trains_and_exports(saves, tmp_path):
    steps = [saves / f"step-{s}" for s in (2, 4, 6)]
    out = average_checkpoints(steps, tmp_path / "average")
    inputs = [_weights(step) for step in steps]
    averaged = _weights(out)
    for name, value in averaged.items():
        expected = sum(w[name] for w in inputs) / 3
        assert (value - expected).abs().max() <= 1e-6 * expected.abs().max(), name
        assert not torch.equal(value, inputs[2][name]) or torch.equal(inputs[0][name], inputs[2][name])
    marker = json.loads((out / "complete.json").read_text())
    assert marker["model_only"] and marker["step"] == 6 and len(marker["averaged_from"]) == 3
    # It exports, and a run starts from it (its first loss is the averaged model's, not a fresh init's).
    export_hf(out, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    fresh = _weights(saves / "step-6")
    assert any(not torch.equal(fresh[n], averaged[n]) for n in averaged)
    for dump, extra in (("from_average", ("--checkpoint.initial_load_path", str(out))), ("fresh", ())):
        train_py(*JOB, "--training.steps", "1", "--training.local_batch_size", "2", "--job.dump_folder",
                 tmp_path / dump, *extra)
    assert logged_losses(tmp_path / "from_average")[1] < logged_losses(tmp_path / "fresh")[1] - 0.1


@pytest.mark.slow
def test_inputs_of_another_run_or_model_are_refused_in_one_line(saves, tmp_path):
    steps = [saves / f"step-{s}" for s in (2, 4)]
    other_run = tmp_path / "other" / "checkpoint" / "step-4"
    shutil.copytree(steps[1], other_run)
    other_model = saves.parent / "edited" / "step-4"
    shutil.copytree(steps[1], other_model)
    marker = json.loads((other_model / "complete.json").read_text())
    marker["model_args"]["dim"] = 512
    (other_model / "complete.json").write_text(json.dumps(marker))
    same_folder = saves / "step-4-edited"
    shutil.copytree(other_model, same_folder)
    cases = [([steps[0]], "at least two step folders"),
             ([steps[0], steps[0]], "named twice"),
             ([steps[0], other_run], "is of another run"),
             ([steps[0], same_folder], "holds another model"),
             ([steps[0], saves / "step-5"], "does not exist")]
    try:
        for folders, message in cases:
            with pytest.raises(ConfigError) as error:
                average_checkpoints(folders, tmp_path / "never")
            assert message in str(error.value) and "\n" not in str(error.value), (message, error.value)
        assert not (tmp_path / "never").exists()
        (tmp_path / "taken").mkdir()
        with pytest.raises(ConfigError, match="exists; name a new folder"):
            average_checkpoints(steps, tmp_path / "taken")
        with pytest.raises(ConfigError, match="a step-N name would be taken for the run's newest save"):
            average_checkpoints(steps, tmp_path / "step-9")
        # one run's folders, spelled one relative and one absolute, are one run
        relative = Path(os.path.relpath(steps[1]))
        assert average_checkpoints([steps[0], relative], tmp_path / "mixed_spelling").is_dir()
    finally:
        shutil.rmtree(same_folder)


@pytest.mark.slow
def test_the_script_averages_the_last_k_in_one_copy_of_the_model(saves):
    """``--last 3``, the default output name; the memory the averaging allocates (its anonymous memory, sampled
    after each weight and after the save) stays within 2x one fp32 copy of the model (the debug model: 9.9 MiB)."""
    done = run_python("scripts/average_checkpoints.py", "--checkpoint_folder", saves, "--last", "3")
    line = done.stdout.strip().splitlines()[-1]
    match = re.search(r"into (\S+); peak RSS ([\d.]+) MiB; the averaging's own memory ([\d.]+) MiB at its largest, one "
                      r"fp32 copy of the model ([\d.]+) MiB", line)
    assert match, line
    assert match.group(1).endswith("step-6-average3")
    added, one_copy = float(match.group(3)), float(match.group(4))
    assert one_copy <= added <= 2 * one_copy, line
    refused = run_python("scripts/average_checkpoints.py", "--checkpoint_folder", saves, "--last", "9", expect=2)
    assert refused.stderr.strip().startswith("error: ") and "fewer than --last 9" in refused.stderr
    shutil.rmtree(saves / "step-6-average3")
