"""Block-causal attention (document masking, ``[model] attention_mask = "block_causal"``, models/attention.py): the
mask itself, a packed row of documents against each document alone, every activation-checkpointing mode and float8,
compiled against eager, and the multi-process layouts (SimpleFSDP, dp2 x tp2, pp2) against one process.

fp32 on CPU: the kernel is SDPA's CPU flash kernel with a boolean mask (FlexAttention has no CPU backward in torch
2.13; ``attention = "flex"`` is refused on CPU in one line).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_mask

from tests.distributed_utils import run_on_ranks
from tests.parity import (
    COMPILED_RTOL,
    EAGER_RTOL,
    SHARDED_NORM_RTOL,
    Recipe,
    assert_parity,
    build_layout,
    max_rel_diff,
    train_reference,
    train_steps,
)
from titan_simple.config import load_job_config
from titan_simple.core.plan import resolve_plan
from titan_simple.errors import ConfigError
from titan_simple.models.attention import AttentionInputs, block_causal_mask, document_ids, mask_mod
from titan_simple.models.llama3 import LLAMA3_FLAVORS, Transformer

EOS = 1  # the built-in tokenizer's (assets/tokenizer/shakespeare_bpe_2k.json)
BLOCK_CAUSAL = ("--model.attention_mask=block_causal",)
# Two blocks: every block runs the same code, and compiling grows with depth.
RECIPE = Recipe(seq_len=64, global_batch=4, steps=4, eos_id=EOS, extra=("--model.n_layers=2", *BLOCK_CAUSAL))


def test_document_ids_count_the_eos_tokens_before_each_token():
    tokens = torch.tensor([[5, 6, EOS, 0, 7, EOS, EOS, 9], [EOS, 3, 3, 3, 3, 3, 3, EOS]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1]]


def test_the_dense_mask_is_flex_attentions_predicate():
    """SDPA's boolean mask equals FlexAttention's dense rendering of causal AND same-document, and of the
    ``mask_mod`` the flex path compiles into its block mask."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8, (3, 96), generator=g)
    tokens[tokens == 2] = EOS  # about one token in four ends a document
    ids = document_ids(tokens, EOS)

    def causal(b, h, q, k):
        return q >= k

    def same_document(b, h, q, k):
        return ids[b, q] == ids[b, k]

    expected = create_mask(and_masks(causal, same_document), 3, 1, 96, 96, device="cpu")
    assert torch.equal(block_causal_mask(ids), expected)
    assert torch.equal(create_mask(mask_mod(ids), 3, 1, 96, 96, device="cpu"), expected)
    assert torch.equal(create_mask(mask_mod(), 1, 1, 96, 96, device="cpu")[0, 0], torch.ones(96, 96).bool().tril())
    assert not torch.equal(expected, expected[0, 0].tril().expand_as(expected))  # documents do cut the rows


@torch.no_grad()
def test_flex_attention_forward_equals_sdpa_on_cpu():
    """The flex path runs forward on CPU (torch 2.13 refuses only its backward): its compiled block mask and
    compiled flex_attention give SDPA's logits, causal and block-causal, within 1e-5 (fp32). Training with flex
    needs CUDA, where ``scripts/gpu_session.sh long_context`` checks it."""
    model = _tiny_model()
    flex = _tiny_model()
    flex.attention_kernel = "flex"
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 2000, (2, 128), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 1 / 16] = EOS
    ids = document_ids(tokens, EOS)
    for inputs in (None, AttentionInputs(document_ids=ids)):
        torch.testing.assert_close(flex(tokens, inputs), model(tokens, inputs), rtol=1e-5, atol=1e-5)


def _tiny_model() -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, max_seq_len=128)
    return Transformer(args)


def test_a_packed_row_of_documents_equals_each_document_alone():
    """Per-token losses and every weight's gradient of one packed row of 4 documents equal the 4 documents run one
    by one (each at its offset in the row, so RoPE sees the same positions), within 1e-5 in fp32; the same row
    with the causal mask does not."""
    model = _tiny_model()
    g = torch.Generator().manual_seed(1)
    lengths = [17, 30, 9, 8]
    documents = [torch.cat([torch.randint(2, 2000, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]
    row = torch.cat(documents)[None]  # [1, 64]
    labels = torch.randint(0, 2000, row.shape, generator=g)

    def losses_and_grads(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")

    model.zero_grad()
    packed = losses_and_grads(model(row, AttentionInputs(document_ids=document_ids(row, EOS))), labels)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone, start = [], 0
    for document, n in zip(documents, lengths, strict=True):
        positions = torch.arange(start, start + n)
        logits = model(document[None], AttentionInputs(positions=positions[None]))
        loss = losses_and_grads(logits, labels[:, start : start + n])
        loss.sum().backward()  # gradients accumulate over the documents
        alone.append(loss.detach())
        start += n
    alone_losses = torch.cat(alone)
    torch.testing.assert_close(packed.detach(), alone_losses, rtol=1e-5, atol=1e-5)
    scale = max(g.abs().max() for g in packed_grads.values())
    worst = max((packed_grads[n] - p.grad).abs().max() / scale for n, p in model.named_parameters())
    assert worst <= 1e-5, worst
    with torch.no_grad():
        causal = losses_and_grads(model(row), labels)
    assert torch.equal(causal[:lengths[0]], packed.detach()[:lengths[0]])  # the first document sees nothing else
    assert (causal[lengths[0]:] - packed.detach()[lengths[0]:]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(RECIPE)


def test_block_causal_trains_unlike_causal_under_every_checkpointing_mode_and_float8(reference):
    """The mask reaches the step (the loss is not the causal one) and every activation-checkpointing mode gives
    the same numbers (recomputation sees the same mask); float8 linears (emulated on CPU) train with it under
    selective op AC as without AC."""
    causal = train_reference(dataclasses.replace(RECIPE, extra=("--model.n_layers=2",)), keep_grads=False)
    assert max_rel_diff(reference["losses"], causal["losses"]) > 1e-3
    for overrides in (("--activation_checkpoint.mode=full",),
                      ("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"),
                      ("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=1")):
        run = train_reference(RECIPE, *overrides, keep_grads=False)
        assert run["losses"] == reference["losses"] and run["norms"] == reference["norms"], overrides
    float8 = ("--model.converters=[\"float8\"]", "--float8.filter_fqns=[\"output\"]")
    plain = train_reference(RECIPE, *float8, keep_grads=False)
    selective = train_reference(RECIPE, *float8, "--activation_checkpoint.mode=selective", keep_grads=False)
    assert max_rel_diff(selective["losses"], plain["losses"]) <= EAGER_RTOL
    assert max_rel_diff(plain["losses"], reference["losses"]) < 0.05  # float8's rounding, not another model


@pytest.mark.parametrize("compile_args", [("--compile.enable",), ("--compile.enable", "--compile.regional")],
                         ids=["whole", "regional"])
def test_compiled_block_causal_equals_eager(reference, compile_args):
    run = train_reference(RECIPE, *compile_args, keep_grads=False)
    assert max_rel_diff(run["losses"], reference["losses"]) <= COMPILED_RTOL
    assert max_rel_diff(run["norms"], reference["norms"]) <= COMPILED_RTOL
    assert run["graph_breaks"] == {}


TWO_RANK_LAYOUTS = {
    "fully_shard2/eager": ("--parallelism.data_parallel_shard_degree=2",),
    "fully_shard2/compiled": ("--parallelism.data_parallel_shard_degree=2", "--compile.enable"),
    "pp2/eager": ("--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                  "--parallelism.pipeline_parallel_microbatch_size=2"),
    "pp2/compiled": ("--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                     "--parallelism.pipeline_parallel_microbatch_size=2", "--compile.enable"),
}
FOUR_RANK_LAYOUTS = {
    "dp2_tp2/eager": ("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"),
    "dp2_tp2/compiled": ("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                         "--compile.enable"),
}


def _train_layouts(rank: int, world_size: int, layouts: dict[str, tuple[str, ...]]) -> dict:
    results = {}
    for key, overrides in layouts.items():
        dp = 2 if "fully_shard2" in key or "dp2" in key else 1
        layout = build_layout(RECIPE.config(f"--training.local_batch_size={RECIPE.global_batch // dp}",
                                            *overrides), world_size)
        results[key] = train_steps(layout, RECIPE)
    return results


@pytest.mark.parametrize("world_size, layouts", [(2, TWO_RANK_LAYOUTS), (4, FOUR_RANK_LAYOUTS)], ids=["2", "4"])
def test_multi_process_block_causal_equals_one_process(reference, world_size, layouts):
    results = run_on_ranks(_train_layouts, world_size, args=(layouts,))
    for key in layouts:
        rtol = COMPILED_RTOL if "compiled" in key else EAGER_RTOL
        assert_parity(results, key, reference, rtol=rtol, norm_rtol=SHARDED_NORM_RTOL)


def test_the_paragraphs_corpus_packs_documents_so_block_causal_trains_otherwise(tmp_path):
    """The README's example: on the built-in plays (a document is a whole play) a row of 129 tokens almost never
    holds an EOS, and block-causal losses were bitwise the causal ones; ``shakespeare_paragraphs`` makes each
    paragraph a document (several per row), and the two masks train differently from step 1."""
    from titan_simple.trainer.trainer import Trainer

    losses = {}
    for mask in ("causal", "block_causal"):
        config = load_job_config(["--training.dataset=shakespeare_paragraphs", f"--model.attention_mask={mask}",
                                  "--model.n_layers=1", "--training.steps=2", "--training.local_batch_size=2",
                                  "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path / mask}"])
        trainer = Trainer(config)
        if mask == "causal":
            assert trainer.dataloader.dataset.index.store.num_documents > 30_000  # one per paragraph
        losses[mask] = trainer.train()
    # untrained and 2 steps: the attention is near uniform, so the difference is small (7e-5 measured) but real,
    # one deterministic process where only the mask differs (bitwise equal on the plays corpus)
    assert max_rel_diff(losses["block_causal"], losses["causal"]) > 1e-5


def test_bad_attention_settings_are_one_line_each(tmp_path):
    with pytest.raises(ConfigError, match=r"attention = 'flex' needs a CUDA GPU .* use attention = 'sdpa'"):
        resolve_plan(load_job_config(["--model.attention=flex"]), 1, "cpu")
    no_eos = tmp_path / "tokenizer.json"
    no_eos.write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "WordLevel", "vocab": {"a": 0}, '
                      '"unk_token": "a"}}')
    with pytest.raises(ConfigError, match=r"attention_mask = 'block_causal' needs the tokenizer's EOS: .*special"):
        resolve_plan(load_job_config(["--model.attention_mask=block_causal", f"--model.tokenizer_path={no_eos}"]),
                     1, "cpu")
    plan = resolve_plan(load_job_config([*BLOCK_CAUSAL]), 1, "cpu")
    assert plan.attention.eos_id == EOS and "attention: block-causal (documents end at EOS id 1), sdpa" in "\n".join(
        plan.describe())
    assert "attention" not in "\n".join(resolve_plan(load_job_config([]), 1, "cpu").describe())
    dry = resolve_plan(load_job_config([*BLOCK_CAUSAL, "--dry_run"]), 1, "cpu")  # reads no tokenizer: no "id None"
    assert dry.attention.eos_id is None and ("block-causal (documents end at the tokenizer's EOS, which a dry run does "
                                             "not read: it prices the mask as causal)") in "\n".join(dry.describe())
