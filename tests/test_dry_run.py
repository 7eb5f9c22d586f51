"""The dry run: one fake rank of a real world size, meta tensors, per-rank memory / collectives / step time.

Each dry run goes through ``train.py`` in its own process (the user's command, and DTensor allows one fake
world per process). A dry run is one single-threaded process: the module starts the dry runs of the tests
selected in it two at a time, ahead (``RUNS``, ``uses``), and each test waits for its own.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch.distributed as dist

from tests.harness import dry_run
from titan_simple.dry_run.hardware import FLOAT8_MATMUL_EFFICIENCY
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer, count_parameters

DryRun = tuple[subprocess.CompletedProcess, dict | None]  # the process, and its dry_run.json if it wrote one


_LOSS = ("--config", "llama3_debug.toml", "--dry_run.world_size", "2", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--dry_run.device", "cpu", "--training.mixed_precision_param", "bfloat16")
TP2_CPU = ("--config", "llama3_debug.toml", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
           "--training.mixed_precision_param", "float32")
RUNS: dict[str, tuple[str, ...]] = {
    "8b": ("--config", "llama3_8b.toml", "--dry_run.world_size", "8"),
    "8b_float8": ("--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--model.converters", "float8"),
    **{f"8b_regional_{reshard}": ("--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--dry_run.device", "h100",
                                  "--compile.regional", "--parallelism.fsdp_reshard_after_forward", reshard)
       for reshard in ("always", "never")},
    "debug_tp2_cpu": (*TP2_CPU, "--dry_run.world_size", "2", "--dry_run.device", "cpu"),
    "405b": ("--config", "llama3_405b.toml", "--dry_run.world_size", "512"),
    "70b_world_100": ("--config", "llama3_70b.toml", "--dry_run.world_size", "100"),
    "8b_batch_4": ("--config", "llama3_8b.toml", "--dry_run.world_size", "8", "--training.local_batch_size", "4"),
    "debug": ("--config", "llama3_debug.toml", "--dry_run.world_size", "2"),
    "70b": ("--config", "llama3_70b.toml", "--dry_run.world_size", "256"),
    "loss_compiled": (*_LOSS, "--compile.enable", "true"),
    "loss_plain": (*_LOSS, "--training.loss_chunks", "1"),
    "loss_chunked": (*_LOSS, "--compile.enable", "false", "--training.loss_chunks", "8"),
}


TIMEOUTS = {"405b": 900, "70b": 900, "70b_world_100": 120}  # seconds; the others 600


def uses(*keys: str) -> Callable:
    """Marks a test as reading the dry runs ``RUNS[key]``, so that the module starts them ahead."""
    def mark(test: Callable) -> Callable:
        test.dry_runs = keys
        return test
    return mark


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Iterator[dict[str, Future[DryRun]]]:
    """The dry runs of this module's selected tests, two at a time, in test order."""
    keys = [key for item in request.session.items if getattr(item, "module", None) is request.module
            for key in getattr(item.function, "dry_runs", ())]
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {key: pool.submit(dry_run, tmp_path_factory.mktemp(key) / "dump", *RUNS[key],
                                timeout=TIMEOUTS.get(key, 600))
               for key in dict.fromkeys(keys)}
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure or -x: the runs not started yet are not started


def test_private_apis_of_the_dry_run_exist():
    """The dry run's two private APIs: the fake process group (torch.testing._internal.distributed.fake_pg)
    and DTensor's shape propagation, which the tracer must not count. If a torch upgrade moves either, this
    fails here, not in a user's dry run."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    import titan_simple.dry_run.tracer  # noqa: F401 -- resolves the aten / _c10d_functional op names it prices

    assert callable(ShardingPropagator._propagate_tensor_meta_non_cached)

    from titan_simple.parallel.fake_process_group import init_fake_process_group

    init_fake_process_group(rank=5, world_size=512)
    try:
        assert dist.get_backend() == "fake"
        assert (dist.get_rank(), dist.get_world_size()) == (5, 512)
        import torch

        t = torch.ones(4)
        dist.all_reduce(t)  # returns at once, moves nothing
    finally:
        dist.destroy_process_group()


@uses("8b")
def test_8b_fsdp8_parameter_memory_is_exactly_a_shard(runs):
    proc, report = runs["8b"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    with __import__("torch").device("meta"):
        n_params = count_parameters(Transformer(LLAMA3_FLAVORS["8B"]))
    memory = report["memory_bytes"]
    assert memory["parameters"] == n_params * 4 // 8  # fp32 master weights, every tensor divides by 8
    assert memory["gradients"] == memory["parameters"]
    assert memory["optimizer_state"] >= 2 * memory["parameters"]  # AdamW: exp_avg + exp_avg_sq (+ step)
    assert report["fits"] and memory["peak"] < memory["reserved"] < memory["device_total"] < memory["device"]
    # One set of fitted constants for every GPU case (dry_run/hardware.py): applied as documented.
    spec = report["device_spec"]
    assert memory["reserved"] == pytest.approx(memory["peak"] * (1 + spec["allocator_overhead"]))
    assert memory["device_total"] == pytest.approx(memory["reserved"] + spec["runtime_bytes"])
    assert report["tokens_per_second_per_gpu"] == pytest.approx(
        report["roofline_tokens_per_second_per_gpu"] * spec["achieved_fraction"])
    kinds = {(c["mesh_dim"], c["kind"], c["dtype"]): c["count"] for c in report["collectives_per_step"]}
    # SimpleFSDP, reshard after forward: every parameter gathered in forward and again in backward (bf16),
    # its gradient reduce-scattered once (fp32); 32 blocks x 9 + embedding + norm + output = 291 parameters.
    assert kinds == {("dp_shard", "all_gather", "bfloat16"): 2 * 291, ("dp_shard", "reduce_scatter", "float32"): 291}
    assert "tokens/s/GPU" in proc.stdout and 0 < report["mfu"] < 1
    # Compiled with reorder: the data-parallel traffic hides behind compute but for one of its 34 buckets (the
    # embedding, 32 blocks, [norm, output]).
    seconds = report["time_seconds"]
    assert report["comm_overlapped"]
    assert seconds["data_parallel_comm_exposed"] == pytest.approx(seconds["data_parallel_comm"] / 34, rel=1e-6)


@uses("8b", "8b_float8")
def test_float8_is_priced_at_the_float8_peak_and_gathers_one_byte_per_element(runs):
    """8B FSDP8, tensorwise float8 with its weights gathered in float8: the 7 linears of each of 32 blocks gathered as
    uint8 (forward and backward), 1 byte per element where bf16 moved 2; one amax all-reduce per step; the float8
    GEMMs priced at the float8 peak (faster than bf16); the fitted efficiency as documented."""
    pytest.importorskip("torchao.float8")
    (proc, bf16), (proc8, float8) = runs["8b"].result(), runs["8b_float8"].result()
    assert proc.returncode == 0 and proc8.returncode == 0, proc8.stderr[-3000:]
    rows = {(c["kind"], c["dtype"]): c for c in float8["collectives_per_step"] if c["mesh_dim"] == "dp_shard"}
    plain = {(c["kind"], c["dtype"]): c for c in bf16["collectives_per_step"] if c["mesh_dim"] == "dp_shard"}
    assert rows[("all_gather", "uint8")]["count"] == 2 * 32 * 7
    assert rows[("all_gather", "bfloat16")]["count"] == 2 * (291 - 32 * 7)
    assert rows[("all_reduce", "float32")]["count"] == 1
    gathered = rows[("all_gather", "uint8")]["bytes"] * 2 + rows[("all_gather", "bfloat16")]["bytes"]
    assert gathered == plain[("all_gather", "bfloat16")]["bytes"]  # the same elements, half the bytes for float8
    assert rows[("reduce_scatter", "float32")] == plain[("reduce_scatter", "float32")]
    assert float8["time_seconds"]["compute_matmul"] < 0.7 * bf16["time_seconds"]["compute_matmul"]
    assert float8["device_spec"]["float8_matmul_efficiency"] == FLOAT8_MATMUL_EFFICIENCY
    assert float8["tokens_per_second_per_gpu"] > bf16["tokens_per_second_per_gpu"]
    assert "weights all-gathered in float8" in proc8.stdout


def test_float8_on_a_gpu_without_float8_matmuls_is_one_error_line(tmp_path):
    pytest.importorskip("torchao.float8")
    proc, report = dry_run(tmp_path, "--config", "llama3_debug.toml", "--dry_run.world_size", "2",
                           "--dry_run.device", "a100", "--model.converters", "float8", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and report is None
    assert len(lines) == 1 and "needs float8 matmuls, which A100 SXM 80GB does not have" in lines[0], proc.stderr


@pytest.mark.parametrize("reshard", ["always", "never"])
@uses("8b_regional_always", "8b_regional_never")
def test_regional_compile_exposes_what_no_region_hides(runs, reshard):
    """8B on 8 H100s, compute-bound, in regions of 2 blocks with the hand-off (each region gathers the next
    region's first block's attention norm and q / k / v projections, and reduces their gradients, behind its own
    compute; the embedding's region does it for the first). Nothing hides the embedding region's traffic (the
    embedding and that first hand-off: forward all-gather and reduce-scatter) and, resharding after forward,
    each region's last bucket's backward re-gather (the second block's w2; in the last region w2, the final norm
    and output). Within a bucket, bf16 gathers and the fp32 reduce-scatter weigh 1 : 1 : 2 (1 : 2 without the
    re-gather). The whole-model graph exposes one bucket (test_8b_fsdp8_parameter_memory_is_exactly_a_shard)."""
    proc, report = runs[f"8b_regional_{reshard}"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["comm_overlapped"]
    with __import__("torch").device("meta"):
        model = Transformer(LLAMA3_FLAVORS["8B"])
    size = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    blocks = list(model.layers.values())
    handed = lambda block: (block.attention_norm, block.attention.wq, block.attention.wk, block.attention.wv)  # noqa: E731
    gather, regather, reduce = 16, (16 if reshard == "always" else 0), 32
    exposed = size(model.tok_embeddings, *handed(blocks[0])) * (gather + reduce) / (gather + regather + reduce)
    for start in range(0, 32, 2):
        last = size(blocks[start + 1].feed_forward.w2) + (size(model.norm, model.output) if start == 30 else 0)
        exposed += last * regather / (gather + regather + reduce)
    seconds = report["time_seconds"]
    share = seconds["data_parallel_comm_exposed"] / seconds["data_parallel_comm"]
    assert share == pytest.approx(exposed / size(model), rel=1e-6)
    # The embedding alone is 6.5% of the weights; the re-gathers add about 3% resharding (measured 9.7% and 6.9%;
    # before the hand-off 13.6% and 9.9%).
    assert (0.09 < share < 0.10) if reshard == "always" else (0.065 < share < 0.075)
    # The hand-off's weights, held from each region's forward to its backward: 16 regions x 48 MiB + a norm
    # (bf16, unsharded), counted in the activations and the peak.
    memory = report["memory_bytes"]
    assert memory["regional_handoff"] == 16 * size(*handed(blocks[0])) * 2 == 16 * (48 * 2**20 + 2 * 4096)
    assert memory["activations"] >= memory["regional_handoff"]


@pytest.mark.slow
@uses("debug_tp2_cpu")
def test_collective_counts_match_a_real_two_process_run(runs):
    """The fake-rank trace issues exactly the collectives a real 2-process gloo step issues. In fp32: without
    data parallel a bf16 step runs under autocast (the trainer's, which the measurement uses too), and autocast
    does nothing to the trace's meta tensors."""
    from titan_simple.dry_run.cpu_measurement import measure

    measured = measure(2, list(TP2_CPU), steps=1, port=29000 + os.getpid() % 1000)
    proc, report = runs["debug_tp2_cpu"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted = Counter()
    for c in report["collectives_per_step"]:
        predicted[f"{c['kind']}/{c['dtype']}"] += c["count"]
    assert dict(predicted) == measured["collective_counts"]
    assert {c["link"] for c in report["collectives_per_step"]} == {"gloo"}  # CPU processes: no NVLink
    assert "tp(2,gloo)" in proc.stdout + proc.stderr


@uses("405b")
def test_405b_on_512_ranks_completes_and_fits(runs):  # ~8 s on a quiet machine (a pp rank: 1/8 of the layers)
    proc, report = runs["405b"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["mesh"] == "pp8 x dp_shard8 x tp8"
    assert report["pipeline"]["local_stages"] == [0, 8]
    assert report["tokens_per_second_per_gpu"] > 0
    dims = {c["mesh_dim"] for c in report["collectives_per_step"]}
    assert dims == {"dp_shard", "tp", "pp"}
    # The shipped config runs async TP: the fused TP collectives are priced as overlapping their matmuls.
    assert report["async_tensor_parallel"]["fused_collectives_per_pass"] > 0
    times = report["time_seconds"]
    assert 0 < times["tensor_parallel_and_other_comm_exposed"] < times["tensor_parallel_and_other_comm"]


@uses("70b_world_100")
def test_world_size_that_does_not_match_the_degrees_is_one_error_line(runs):
    proc, report = runs["70b_world_100"].result()
    assert proc.returncode == 2 and report is None
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: [dry_run] world_size = 100"), proc.stderr


@pytest.mark.slow
@uses("8b_batch_4")
def test_a_config_that_does_not_fit_names_the_largest_contributor(runs):
    proc, report = runs["8b_batch_4"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not report["fits"] and report["memory_bytes"]["device_total"] > report["memory_bytes"]["device"]
    assert report["largest_contributor"] == "activations"
    assert "mode = full" in report["suggestion"]  # the config already uses selective AC
    assert "DOES NOT FIT" in proc.stdout and "largest contributor: activations" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("key", "mesh"), [("debug", "dp_shard2"), ("70b", "dp_shard32 x tp8")])
@uses("debug", "70b")
def test_shipped_configs_dry_run_at_their_world_size(runs, key, mesh):
    """With the 8B and 405B tests above, every shipped config plans at its intended world size and fits."""
    proc, report = runs[key].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["mesh"] == mesh and report["fits"]
    assert report["memory_bytes"]["device_total"] < report["memory_bytes"]["device"]
    assert "tokens/s/GPU" in proc.stdout and report["tokens_per_second_per_gpu"] > 0


@uses("loss_compiled", "loss_chunked")
def test_compiled_loss_is_modelled_as_keeping_no_fp32_log_probs(runs):
    """Where the training step compiles the loss with the model (one graph: no TP, no PP), the plan runs the plain
    loss (Inductor fuses it) and the dry run models that fused cross-entropy as keeping the logits' gradient in
    their dtype, no fp32 log-probabilities: its activations are those of the chunked eager loss."""
    compiled, chunked = runs["loss_compiled"].result()[1], runs["loss_chunked"].result()[1]
    assert "cross-entropy, compiled with the model (fused by Inductor" in "\n".join(compiled["plan"])
    assert compiled["memory_bytes"]["activations"] == chunked["memory_bytes"]["activations"]


@uses("loss_plain", "loss_chunked")
def test_chunked_loss_is_modelled_as_keeping_the_logits_gradient_not_fp32_log_probs(runs):
    """The chunked cross-entropy (``[training] loss_chunks``) keeps, instead of the fp32 [tokens, vocab]
    log-probabilities, the logits' gradient in their dtype (bf16 here): half the bytes."""
    plain, chunked = runs["loss_plain"].result()[1], runs["loss_chunked"].result()[1]
    tokens_x_vocab = 2 * 64 * LLAMA3_FLAVORS["debugmodel"].vocab_size
    saved = plain["memory_bytes"]["activations"] - chunked["memory_bytes"]["activations"]
    assert tokens_x_vocab * 2 <= saved <= tokens_x_vocab * 2 + 64  # fp32 minus bf16, to a few scalars
