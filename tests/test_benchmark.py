"""scripts/benchmarks/benchmark.py: the configuration matrix, the interleaved schedule, the aggregation and table, the
targets, and one real job end to end (torchrun, the Trainer, the worker's JSON); the harness every benchmark script
shares (scripts/benchmarks/harness.py): its doc blocks and its metrics reader."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from tests.harness import REPO, load_script, run_python

# Registered as their own names: the scripts ``import harness`` as their sibling (Python puts a script's folder on
# sys.path, pytest does not), so the harness loads first.
harness = load_script("scripts/benchmarks/harness.py")
benchmark = load_script("scripts/benchmarks/benchmark.py")


def test_matrix_has_every_configuration_the_issue_asks_for():
    configs = {c.name: c for c in benchmark.config_matrix()}
    assert set(configs) == {
        "fsdp2_eager", "fsdp2_compile", "simple_eager", "simple_default",
        "simple_none", "simple_none_reorder", "simple_tb", "simple_tb_reorder", "simple_auto_reorder",
        "simple_regional", "simple_regional_1", "simple_regional_4",
    }
    for name, blocks in (("simple_regional", None), ("simple_regional_1", 1), ("simple_regional_4", 4)):
        regional = configs[name]
        assert regional.compiled and regional.simple and "--compile.regional=true" in regional.overrides
        blocks_overrides = [o for o in regional.overrides if "regional_blocks" in o]
        assert blocks_overrides == ([] if blocks is None else [f"--compile.regional_blocks={blocks}"])
    assert not configs["fsdp2_eager"].compiled and not configs["fsdp2_eager"].simple
    assert configs["fsdp2_compile"].compiled and not configs["fsdp2_compile"].simple
    assert configs["simple_eager"].simple and not configs["simple_eager"].compiled
    tb = configs["simple_tb_reorder"]
    assert tb.compiled and tb.simple
    assert "--compile.bucketing=transformer_block" in tb.overrides and "--compile.reorder=true" in tb.overrides
    assert "--compile.reorder=false" in configs["simple_none"].overrides
    assert not any(o.startswith("--compile.bucketing") for o in configs["simple_default"].overrides)


def test_peer_workload_is_torchtitans_debugmodel_shape_with_selective_ac(tmp_path):
    from titan_simple.config import load_job_config

    w = benchmark.WORKLOADS["peer"]
    job = load_job_config(benchmark.trainer_overrides(w, benchmark.config_matrix()[0], 4, str(tmp_path)))
    assert (job.model.flavor, job.training.seq_len, job.training.local_batch_size) == ("debugmodel", 2048, 8)
    assert job.activation_checkpoint.mode == "selective"


def test_every_configuration_is_a_valid_trainer_config(tmp_path):
    from titan_simple.config import load_job_config

    for workload in benchmark.WORKLOADS.values():
        for config in benchmark.config_matrix():
            job = load_job_config(benchmark.trainer_overrides(workload, config, steps=4, dump_folder=str(tmp_path)))
            assert job.training.seq_len == workload.seq_len
            assert job.compile.enable == config.compiled
            assert job.parallelism.fsdp_implementation == ("simple" if config.simple else "fsdp2")


def test_compute_heavy_workload_meets_the_issue_minimum():
    from titan_simple.models.llama3 import LLAMA3_FLAVORS

    w = benchmark.WORKLOADS["compute"]
    args = LLAMA3_FLAVORS[w.flavor]
    assert args.n_layers >= 8 and args.dim >= 512 and w.seq_len >= 512
    assert benchmark.WORKLOADS["comm"].seq_len * benchmark.WORKLOADS["comm"].local_batch_size <= 64


def test_schedule_interleaves_repeats_and_rotates_the_order():
    configs = benchmark.config_matrix()[:3]
    workloads = [benchmark.WORKLOADS["comm"]]
    runs = benchmark.run_schedule(workloads, [2, 4], configs, repeats=2)
    assert len(runs) == 2 * 2 * 3
    # Repeat 0 of everything comes before any repeat 1.
    assert [r.repeat for r in runs] == [0] * 6 + [1] * 6
    assert Counter(r.key for r in runs) == Counter({k: 2 for k in {r.key for r in runs}})
    first = [r.config.name for r in runs if r.repeat == 0 and r.world_size == 2]
    second = [r.config.name for r in runs if r.repeat == 1 and r.world_size == 2]
    assert second == first[1:] + first[:1]
    # Configuration-major: a budget cut drops whole configurations, not a world size.
    assert [(r.config.name, r.world_size) for r in runs[:2]] == [(first[0], 2), (first[0], 4)]
    fewer = benchmark.run_schedule(workloads, [2, 4], configs, repeats=2, repeats_by_world_size={4: 1})
    assert Counter(r.world_size for r in fewer) == {2: 6, 4: 3}


def test_median_ignores_missing_values():
    assert benchmark.median([3.0, None, 1.0, 2.0]) == 2.0
    assert benchmark.median([1.0, 2.0]) == 1.5
    assert benchmark.median([None]) != benchmark.median([None])  # nan


def test_collective_kinds_of_functional_and_c10d_ops():
    kind = benchmark._collective_kind
    assert kind("_c10d_functional.all_gather_into_tensor") == "all_gather"
    assert kind("c10d._allgather_base_") == "all_gather"
    assert kind("c10d.allgather_into_tensor_coalesced_") == "all_gather"
    assert kind("_c10d_functional.reduce_scatter_tensor") == "reduce_scatter"
    assert kind("c10d._reduce_scatter_base_") == "reduce_scatter"
    assert kind("c10d.allreduce_") == "all_reduce"
    assert kind("_c10d_functional.all_reduce") == "all_reduce"
    assert kind("c10d.broadcast_") is None


def _job(step_walls, durations, peaks, starts, tokens=32, counted=None, plan=None):
    rank = {
        "step_durations_s": durations,
        "step_walls_s": [None, *step_walls],
        "measured_steps": [1, 2, 3],
        "local_tokens": tokens,
        "peak_rss_bytes": peaks,
        "start_rss_bytes": starts,
        "collectives_counted": counted or {"all_gather": 10, "reduce_scatter": 5, "all_reduce": 1},
        "matmul_flops_per_s": 1e10,
        "flops_per_token": 1e7,
    }
    return {"ranks": [rank, rank], "comm_plan_counts": plan}


def test_profiler_events_count_one_per_collective():
    # What torch.profiler records on gloo for: dist.all_gather_into_tensor, a functional all-gather, a
    # functional reduce-scatter, dist.all_reduce (measured with torch 2.13).
    names = [
        "c10d::_allgather_base_", "gloo:all_gather",
        "_c10d_functional::all_gather_into_tensor", "c10d::allgather_into_tensor_coalesced_", "gloo:all_gather",
        "_c10d_functional::reduce_scatter_tensor", "c10d::reduce_scatter_tensor_coalesced_", "gloo:all_reduce",
        "c10d::allreduce_", "gloo:all_reduce", "_c10d_functional::wait_tensor", "aten::mm",
    ]
    assert benchmark.count_collectives(names) == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


def test_summary_uses_medians_of_measured_steps():
    mib = benchmark.MIB
    job = _job(step_walls=[0.5, 0.25, 0.5, 9.0], durations=[10.5, 0.5, 0.25, 0.5, 0.5],
               peaks=[900 * mib, 600 * mib, 610 * mib, 605 * mib, 0], starts=[500 * mib] * 5,
               plan={"forward": {"all_gather": 4}, "backward": {"all_gather": 3, "reduce_scatter": 4}})
    configs = {c.name: c for c in benchmark.config_matrix()}
    s = benchmark.summarize_run(job, configs["simple_tb_reorder"])
    assert s["tokens_per_s"] == pytest.approx(32 / 0.5)  # median of 64, 128, 64; the counting step is excluded
    assert s["compile_s"] == pytest.approx(10.5 - 0.5)
    assert s["peak_rss_mib"] == pytest.approx(605)
    assert s["rss_delta_mib"] == pytest.approx(105)
    assert s["mfu_percent"] == pytest.approx(100 * 64 * 1e7 / 1e10)
    assert s["collectives"] == {"all_gather": 10, "reduce_scatter": 5, "all_reduce": 1}


def _result(tps, peak=500.0, delta=50.0):
    return {"tokens_per_s": tps, "mfu_percent": 1.0, "peak_rss_mib": peak, "rss_delta_mib": delta,
            "collectives": {"all_gather": 2, "reduce_scatter": 1}, "compile_s": 0.0}


def test_table_and_targets():
    results = {
        ("comm", 2, "fsdp2_eager"): _result(100.0, peak=600),
        ("comm", 2, "simple_tb_reorder"): _result(160.0, peak=590),
        ("compute", 2, "fsdp2_eager"): _result(1000.0),
        ("compute", 2, "fsdp2_compile"): _result(1300.0),
        ("compute", 2, "simple_tb_reorder"): _result(1250.0, delta=40.0),
    }
    table = benchmark.results_table(results, benchmark.config_matrix())
    lines = table.splitlines()
    assert len(lines) == 2 + len(results)
    assert "| communication-heavy | 2 | SimpleFSDP compiled, transformer_block + reorder | 160 | 1.60x |" in table
    assert "| 2/1/0 |" in table
    targets = "\n".join(benchmark.check_targets(results))
    assert "(simple_tb_reorder) = 1.60x FSDP2 eager (target >= 1.5x): met" in targets
    assert "= 1.25x FSDP2 eager (target >= 1.2x): met" in targets
    assert "= 0.96x FSDP2 per-block compile (target >= 1.0x): MISSED" in targets
    assert "peak RSS of simple_tb_reorder 590 MiB vs FSDP2 eager 600 MiB (-10; target <= FSDP2 eager): met" in targets


def test_quick_tiny_job_end_to_end(tmp_path):
    """One real job: torchrun, 2 ranks, the Trainer, the worker's JSON read back into a report (~30 s)."""
    out = tmp_path / "bench"
    run_python(REPO / "scripts" / "benchmarks" / "benchmark.py", "--quick", "--workloads=tiny", "--world-sizes=2",
               "--configs=fsdp2_eager", "--steps=1", f"--out={out}", f"--plot={tmp_path / 'b.png'}", env=os.environ,
               timeout=300)  # the user's environment: the benchmark sets its jobs' own
    raw = json.loads((out / "results.json").read_text())
    assert len(raw) == 1
    s = raw[0]["summary"]
    assert s["tokens_per_s"] > 0 and s["peak_rss_mib"] > 100 and 0 < s["mfu_percent"] < 100
    # FSDP2 gathers each of the 6 blocks and the root once in forward, the blocks again in backward.
    assert s["collectives"]["all_gather"] == 13 and s["collectives"]["reduce_scatter"] == 7
    report = (out / "report.md").read_text()
    assert "| smoke test | 2 | FSDP2 eager |" in report


DOC = """# Results

Intro, with a <!-- not a marker --> comment.

<!-- table: begin -->
| old | table |
<!-- table: end -->

Text after the block stays.
<!-- table: end -->
"""


def test_a_doc_block_is_replaced_between_its_markers_and_nothing_else_changes():
    begin, end = "<!-- table: begin -->", "<!-- table: end -->"
    new = harness.splice(DOC, begin, end, "| new |\n|---|")
    head, block_and_tail = DOC.split(begin)
    assert new.startswith(head)
    assert new[len(head):].startswith(f"{begin}\n| new |\n|---|\n{end}\n\nText after the block stays.\n{end}\n")
    assert "| old | table |" not in new
    # Rewriting is idempotent: the same text spliced again gives the same doc.
    assert harness.splice(new, begin, end, "| new |\n|---|") == new


def test_a_missing_marker_is_one_clear_error(tmp_path):
    for begin, end, missing in (("<!-- other: begin -->", "<!-- other: end -->", "<!-- other: begin -->"),
                                ("<!-- table: begin -->", "<!-- table: stop -->", "<!-- table: stop -->")):
        with pytest.raises(ValueError, match=f"no '{missing}' marker"):
            harness.splice(DOC, begin, end, "x")
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    with pytest.raises(SystemExit) as exit_info:
        harness.write_block(doc, "<!-- other: begin -->", "<!-- other: end -->", "x")
    message = str(exit_info.value.code)
    assert message.startswith(f"{doc}: no '<!-- other: begin -->' marker") and "\n" not in message
    assert doc.read_text() == DOC  # nothing written


def test_every_doc_marker_a_benchmark_names_is_in_the_docs():
    """A rerun finds its block: every marker string a script under scripts/benchmarks holds is in a doc (a missing
    block is an error, no longer appended at the end of the doc)."""
    markers = {m for script in (REPO / "scripts" / "benchmarks").glob("*.py")
               for m in re.findall(r"\"(<!-- [^\"]*? -->)\"", script.read_text())}
    assert len(markers) >= 18, markers  # 9 scripts, a begin and an end each
    docs = "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    assert sorted(m for m in markers if m not in docs) == []


def test_metrics_are_read_from_a_dump_folder_skipping_a_cut_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert harness.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert harness.read_metrics(tmp_path / "metrics.jsonl") == harness.read_metrics(tmp_path)


def test_a_job_runs_from_the_repo_root_with_the_benchmark_environment():
    job = harness.launch("-c", "import json, os; print(json.dumps([os.getcwd(), os.environ['OMP_NUM_THREADS'], "
                         "os.environ['PYTHONPATH'].split(os.pathsep)[0]]))")
    assert job.check("the probe").last_json() == [str(REPO), "1", str(REPO)]
    failed = harness.launch("-c", "import sys; sys.exit('broken: 42')")
    with pytest.raises(SystemExit, match=r"the probe failed \(1\):\nbroken: 42"):
        failed.check("the probe")
