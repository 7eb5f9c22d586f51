"""titan_simple.compile.compiler: Inductor bucketing / reordering of SimpleFSDP collectives, the comm plan.

The multi-process tests compile a 2-layer Llama 3 debug model (fp32) once per bucketing / reorder setting, in
ONE set of processes (compilation dominates the runtime): under SimpleFSDP fully_shard on 2 gloo ranks they
check the collective counts in the recorded comm plan, the prefetch order with ``reorder`` and that 10 steps
of losses match the unbucketed compile. On a 2 x 2 (dp_shard, tp) mesh, tests/test_tensor_parallel.py trains
transformer_block and auto bucketing against one process and counts their dp collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed_utils import run_on_ranks
from tests.inductor_code import overlap_in_generated_code
from tests.parity import COMPILED_RTOL
from titan_simple.compile import compiler as compile_mod
from titan_simple.compile.compiler import compile_model, transformer_block_plan
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer
from titan_simple.parallel.simple_fsdp import data_parallel, sharded_parameters

N_LAYERS = 2
SEQ_LEN = 32
LOCAL_BATCH = 2
STEPS = 10
# Measured: bucketing and reordering change no arithmetic, only which ops run where; the losses agree to
# ~1e-7 relative (differences come from Inductor fusing differently around the moved collectives).


def _args():
    return dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=N_LAYERS, max_seq_len=SEQ_LEN)


def test_transformer_block_plan():
    with torch.device("meta"):
        model = Transformer(_args())
    assert transformer_block_plan(model) == ["tok_embeddings", "layers.0", "layers.1", ["norm", "output"]]


def test_bad_bucketing_is_rejected():
    with pytest.raises(ValueError, match="bucketing"):
        compile_model(torch.nn.Linear(2, 2), bucketing="greedy")


def test_the_gpu_runtime_model_is_inductors_analytical_one():
    """On CUDA the overlap scheduler prices nodes with Inductor's analytical model: no calibration, nothing sent."""
    from titan_simple.compile.inductor_private import analytical_runtime_ms, rank_local_compile_options

    assert compile_mod.runtime_estimator(cpu=False) is analytical_runtime_ms
    from titan_simple.compile.compile_plan import CompilePlan

    plan = CompilePlan(mode="whole")
    assert rank_local_compile_options().items() <= plan.inductor_options().items()


# A stand-in for CUDA's SDPA flash kernel, which returns 9 values, SymInts among them (CPU's returns 2): control
# deps must wrap such a node, and make it a dependency of another, without changing a result.
@torch.library.custom_op("titan_simple_test::attention_like", mutates_args=())
def _attention_like(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    scores = q @ k.transpose(-1, -2)
    return scores.softmax(-1), scores.logsumexp(-1), q.shape[-2], k.shape[-2]


@_attention_like.register_fake
def _(q, k):
    scores = q @ k.transpose(-1, -2)
    return torch.empty_like(scores), scores.new_empty(scores.shape[:-1]), q.shape[-2], k.shape[-2]


class _WrapMultiOutputNode(compile_mod.CustomGraphPass):
    """Pins the multi-output node after the matmul, and the next multiplication after the multi-output node."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from titan_simple.compile.inductor_private import add_control_deps, control_deps

        nodes = list(graph.nodes)
        mm = next(n for n in nodes if n.target is torch.ops.aten.mm.default)
        attention = next(n for n in nodes if n.target is torch.ops.titan_simple_test.attention_like.default)
        mul = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
        add_control_deps(graph, {attention: [mm]})
        wrapped = next(n for n in graph.nodes if n.target is control_deps)
        add_control_deps(graph, {mul: [wrapped]})
        self.wrapped = sum(n.target is control_deps for n in graph.nodes)

    def uuid(self) -> str:
        return "wrap-multi-output-node"


@pytest.mark.parametrize("dynamic", [False, True])
def test_control_deps_keep_multi_output_symint_nodes_correct(dynamic):
    def f(x, w):
        h = x @ w
        probs, lse, rows_q, rows_k = torch.ops.titan_simple_test.attention_like(h, h)
        return probs * 2 + rows_q, lse.sum() + rows_k

    x, w = torch.randn(3, 8, 4), torch.randn(4, 4)
    expected = f(x, w)
    torch._dynamo.reset()
    wrap = _WrapMultiOutputNode()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic, options={"post_grad_custom_post_pass": wrap})
    results = compiled(x, w)
    assert wrap.wrapped == 2
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(result, reference)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    tokens = torch.randint(0, _args().vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(model, optimizer, losses: list[float], dp_rank: int, dp_size: int, dp_group, step: int) -> None:
    """One step on this data-parallel rank's batch; appends the global mean loss (summed over ``dp_group``)."""
    inputs, labels = _batch(step, dp_rank)
    tokens = LOCAL_BATCH * SEQ_LEN * dp_size
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
    (loss / tokens).backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_group)
    losses.append(total.item() / tokens)


def _train_settings(rank: int, world_size: int, settings: list[tuple[str, bool]], dump_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    results = {}
    for bucketing, reorder in settings:
        torch._dynamo.reset()
        with torch.device("meta"):
            model = Transformer(_args())
        data_parallel(model, mesh, mode="fully_shard")
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad(), sharded_parameters():
            model.init_weights(buffer_device=torch.device("cpu"))
        key = f"{bucketing}{'+reorder' if reorder else ''}"
        dump = os.path.join(dump_root, key)
        recorder = compile_model(model, backend="inductor", bucketing=bucketing, reorder=reorder, dump_folder=dump)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses: list[float] = []
        step_fn = functools.partial(_train_step, model, optimizer, losses, rank, world_size, None)
        generated = overlap_in_generated_code(functools.partial(step_fn, 0))  # compiles forward and backward
        for step in range(1, STEPS):
            step_fn(step)
        results[key] = {"losses": losses, "graphs": recorder.graphs, "generated_overlap": generated}
    return results


def _first_index(colls, kind, module_prefix):
    for c in colls:
        if c["kind"] == kind and any(m == module_prefix or m.startswith(module_prefix + ".") for m in c["modules"]):
            return c
    return None


@pytest.mark.slow
def test_bucketing_and_reordering(tmp_path):
    settings = [("none", False), ("none", True), ("transformer_block", False), ("transformer_block", True),
                ("auto", True)]
    results = run_on_ranks(_train_settings, world_size=2, args=(settings, str(tmp_path)))
    res = results[0]
    n_buckets = len(["tok_embeddings", *[f"layers.{i}" for i in range(N_LAYERS)], "norm+output"])
    n_params = sum(1 for _ in Transformer(dataclasses.replace(_args(), max_seq_len=SEQ_LEN)).parameters())

    def count(key, graph, kind):
        return sum(c["kind"] == kind for c in res[key]["graphs"][graph])

    summary = {
        k: {g: {kind: count(k, g, kind) for kind in ("all_gather", "reduce_scatter")} for g in ("forward", "backward")}
        for k in res
    }
    print("collective counts:", json.dumps(summary))

    # Unbucketed: one all-gather per parameter in forward, one reduce-scatter per parameter in backward.
    assert count("none", "forward", "all_gather") == n_params
    assert count("none", "backward", "reduce_scatter") == n_params
    # transformer_block: exactly one per planned bucket.
    for key in ("transformer_block", "transformer_block+reorder"):
        assert count(key, "forward", "all_gather") == n_buckets, summary[key]
        assert count(key, "backward", "reduce_scatter") == n_buckets, summary[key]
        assert count(key, "backward", "all_gather") <= n_buckets, summary[key]  # re-gathers (reshard)
    # auto: fewer collectives than none.
    total = lambda key: sum(len(res[key]["graphs"][g]) for g in ("forward", "backward"))  # noqa: E731
    assert total("auto+reorder") < total("none"), summary

    # reorder: block 1's all-gather is issued while block 0 still computes (overlaps a block-0 compute op).
    fwd = res["transformer_block+reorder"]["graphs"]["forward"]
    ag1 = _first_index(fwd, "all_gather", "layers.1")
    assert ag1 is not None, fwd
    assert any((o["module"] or "").startswith("layers.0") for o in ag1["overlaps"]), ag1
    # ... and not without reorder.
    fwd_plain = res["transformer_block"]["graphs"]["forward"]
    ag1_plain = _first_index(fwd_plain, "all_gather", "layers.1")
    assert not any((o["module"] or "").startswith("layers.0") for o in ag1_plain["overlaps"]), ag1_plain
    # The code Inductor generated keeps that order: compute kernels run between a collective's start and its
    # wait, in forward and backward. (Without control_deps pinning it, Inductor's scheduler moved every
    # start back next to its wait: 0 everywhere.)
    for key in ("transformer_block+reorder", "auto+reorder", "none+reorder"):
        gaps = res[key]["generated_overlap"]
        print(f"{key}: compute kernels between start and wait in the generated code: {gaps}")
        assert len(gaps) == 2 and all(max(g, default=0) > 0 for g in gaps), (key, gaps)
    assert all(max(g, default=0) == 0 for g in res["transformer_block"]["generated_overlap"]), res[
        "transformer_block"]["generated_overlap"]

    # Same losses as the unbucketed compile.
    ref = torch.tensor(res["none"]["losses"], dtype=torch.float64)
    for key, r in res.items():
        got = torch.tensor(r["losses"], dtype=torch.float64)
        rel = ((got - ref).abs() / ref.abs()).max().item()
        print(f"{key}: max relative loss difference vs none = {rel:.2e}")
        assert rel <= COMPILED_RTOL, (key, rel, r["losses"], res["none"]["losses"])

    # The comm plan files (rank 0 writes them).
    plan = json.loads((tmp_path / "transformer_block+reorder" / "comm_plan.json").read_text())
    assert set(plan["graphs"]) == {"forward", "backward"}
    text = (tmp_path / "transformer_block+reorder" / "comm_plan.txt").read_text()
    print(text)
    assert "all_gather" in text and "reduce_scatter" in text


def test_bucketing_on_a_per_block_compiled_layout_warns(caplog):
    """FSDP2 (and TP inside a pipeline stage, and zero-bubble schedules) compile block by block: there is no
    whole-step graph, so [compile] bucketing / reorder cannot apply; the user is told rather than ignored."""
    from titan_simple.config import load_job_config
    from titan_simple.core.plan import resolve_plan

    def plan(*overrides: str) -> str:
        config = load_job_config(["--config", "llama3_debug.toml", "--compile.enable", *overrides])
        return resolve_plan(config, 1, "cpu").compile.mode

    with caplog.at_level("WARNING", logger="titan_simple.core.plan"):
        assert plan("--parallelism.fsdp_implementation=fsdp2", "--compile.bucketing=auto") == "per_block"
    assert "bucketing = 'auto', reorder = True ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="titan_simple.core.plan"):
        # the defaults (transformer_block + reorder): no noise
        assert plan("--parallelism.fsdp_implementation=fsdp2") == "per_block"
        # SimpleFSDP: the model and its loss as one graph, where bucketing applies
        assert plan("--compile.bucketing=transformer_block", "--compile.reorder") == "whole_with_loss"
    assert "ignored" not in caplog.text


def test_gpu_scheduling_options_are_torchtitans_and_real_inductor_keys():
    import torch._inductor.config as inductor_config

    assert compile_mod.gpu_scheduling_options(True, "transformer_block") == {}  # CPU: Inductor's defaults
    assert compile_mod.gpu_scheduling_options(False, "none") == {"reorder_for_peak_memory": False}
    options = compile_mod.gpu_scheduling_options(False, "auto")
    assert options == {"reorder_for_peak_memory": False, "allow_buffer_reuse": False}
    assert all(hasattr(inductor_config, key) for key in options)  # torch.compile would reject an unknown key
