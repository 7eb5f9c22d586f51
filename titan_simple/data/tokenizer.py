"""Text <-> token ids, from a Hugging Face ``tokenizer.json`` or a tiktoken-format ``tokenizer.model``.

Both formats end up as one ``tokenizers.Tokenizer``. A tiktoken file (Llama 3's ``tokenizer.model``: one
``<base64 token bytes> <rank>`` per line) is converted in code to an equivalent byte-level BPE, so the project
needs no tiktoken dependency:

* vocabulary: every token's bytes written with the GPT-2 byte -> printable-unicode alphabet, id = rank;
* merges: tiktoken has none, it merges whichever adjacent pair forms the lowest-ranked token. A BPE merge
  list with, for every token, each split into two existing tokens, ordered by the rank of the token they
  form, makes the BPE model pick the same pairs;
* pre-tokenizer: Llama 3's split regex, then the byte-level mapping (its own regex off);
* Llama 3's 256 special tokens, numbered right after the BPE ids.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from titan_simple.errors import ConfigError

# Llama 3's pre-tokenization pattern: contractions, words (with one leading non-letter), numbers of at most
# three digits, punctuation runs, newlines and other whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
NUM_LLAMA3_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (the first gets id = number of BPE tokens, 128000 there)."""
    named = {
        0: BEGIN_OF_TEXT, 1: END_OF_TEXT, 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "<|eot_id|>"
    }
    tokens, reserved = [], 0
    for offset in range(NUM_LLAMA3_SPECIAL_TOKENS):
        if offset in named:
            tokens.append(named[offset])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Llama 3's regex split, then the byte -> unicode mapping (also used by scripts/train_tokenizer.py)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 alphabet: each byte as a printable character, so byte strings can be BPE vocabulary keys.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are moved, in
    order, to code points 256 and up.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _as_unicode(token: bytes) -> str:
    alphabet = bytes_to_unicode()
    return "".join(alphabet[b] for b in token)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: ``<base64 token> <rank>`` per line."""
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"tokenizer {path} line {line_number} is not '<base64 token> <rank>'; "
                "give a tiktoken tokenizer.model or a Hugging Face tokenizer.json"
            ) from None
    if not ranks:
        raise ConfigError(f"tokenizer {path} is empty; give a tiktoken tokenizer.model or a tokenizer.json")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks.

    Every way of splitting a token into two tokens that both exist becomes a merge, ranked by the token it
    produces (ties: by the ranks of the two halves). Applying merges in that order reproduces tiktoken's rule
    of always joining the adjacent pair whose concatenation has the lowest rank.
    """
    ranked_merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked_merges.append((rank, ranks[left], ranks[right], left, right))
    ranked_merges.sort()
    return [(left, right) for *_, left, right in ranked_merges]


def tokenizer_from_tiktoken(path: Path) -> HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to a tiktoken file, plus Llama 3's specials."""
    ranks = read_tiktoken_ranks(path)
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise ConfigError(
            f"tokenizer {path} lacks {len(missing_bytes)} of the 256 single-byte tokens (e.g. byte "
            f"{missing_bytes[0]}), so some text cannot be encoded; is it a complete tiktoken BPE file?"
        )
    vocab = {_as_unicode(token): rank for token, rank in ranks.items()}
    merges = [(_as_unicode(left), _as_unicode(right)) for left, right in merges_from_ranks(ranks)]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    # ignore_merges: like tiktoken, a pre-token that is itself in the vocabulary becomes that one id.
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    # Specials are numbered right after the highest BPE id (Llama 3: 128000 ... 128255).
    first_special_id = max(ranks.values()) + 1
    if tokenizer.get_vocab_size(with_added_tokens=False) != first_special_id:
        raise ConfigError(f"tokenizer {path} has duplicate or missing ranks; is it a tiktoken BPE file?")
    specials = [AddedToken(token, special=True, normalized=False) for token in llama3_special_tokens()]
    tokenizer.add_special_tokens(specials)
    return tokenizer


def _looks_like_json(path: Path) -> bool:
    if path.suffix == ".json":
        return True
    with path.open("rb") as f:
        return f.read(64).lstrip().startswith(b"{")


class Tokenizer:
    """Encodes text for pretraining (optionally framed by BOS/EOS) and decodes ids back to text.

    ``path`` is a Hugging Face ``tokenizer.json`` or a tiktoken-format BPE file such as Llama 3's
    ``tokenizer.model``; the format is recognised from the content.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(
                f"tokenizer file not found: {path}; set [model] tokenizer_path to a tokenizer.json or "
                "tokenizer.model, or create one with scripts/train_tokenizer.py"
            )
        if _looks_like_json(self.path):
            try:
                self._tokenizer = HFTokenizer.from_file(str(self.path))
            except Exception as error:  # tokenizers raises a bare Exception on a malformed file
                raise ConfigError(f"tokenizer {path} is not a valid tokenizer.json: {error}") from None
        else:
            self._tokenizer = tokenizer_from_tiktoken(self.path)
        self.bos_id = self._special_id((BEGIN_OF_TEXT, "<s>"))
        self.eos_id = self._special_id((END_OF_TEXT, "</s>"))

    def _special_id(self, candidates: tuple[str, ...]) -> int:
        """Id of the first of ``candidates`` among the added tokens."""
        added_tokens = self._tokenizer.get_added_tokens_decoder().items()
        added = {token.content: token_id for token_id, token in added_tokens}
        for name in candidates:
            if name in added:
                return added[name]
        raise ConfigError(
            f"tokenizer {self.path} has none of the special tokens {' / '.join(candidates)}; "
            "use a tokenizer with BOS/EOS tokens (e.g. one made by scripts/train_tokenizer.py)"
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding needs at least this many rows)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        # add_special_tokens=False: a tokenizer.json's own post-processor must not add a second BOS.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``encode`` of each text; the Rust tokenizer spreads a batch over threads (TOKENIZERS_PARALLELISM)."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [[self.bos_id] * bos + e.ids + [self.eos_id] * eos for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept, written as their names."""
        id_list = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # also takes tensors
        return self._tokenizer.decode(id_list, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(path: str) -> Tokenizer:
    return Tokenizer(path)
