"""Tokenizers: byte-level, and GPT-2's BPE from local files only."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.data import (
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    TokenizerError,
    TokenizerUnavailableError,
    get_tokenizer,
)
from blutrain.data.tokenizer import R50K_FILE, cache_path, data_gym_to_ranks, find_cached_ranks

# A tiny GPT-2-style vocabulary: the 256 bytes (rank = byte value), then these merges in rank order.
MERGE_PAIRS = [
    (b"h", b"e"),
    (b"l", b"l"),
    (b"he", b"ll"),
    (b"hell", b"o"),
    (b" ", b"w"),
    (b"o", b"r"),
    (b" w", b"or"),
    (b"l", b"d"),
    (b" wor", b"ld"),
]
MERGES = [first + second for first, second in MERGE_PAIRS]


def _ranks_file(path: Path, merges: list[bytes] = MERGES, skip_byte: int | None = None) -> Path:
    tokens = [bytes([b]) for b in range(256) if b != skip_byte] + merges
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> GPT2Tokenizer:
    return GPT2Tokenizer(_ranks_file(tmp_path_factory.mktemp("ranks") / "tiny.tiktoken"))


@pytest.fixture
def empty_tiktoken_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    return cache


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_byte_tokenizer_round_trips_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_invalid_utf8_with_replacement_characters() -> None:
    assert ByteTokenizer().decode([0x68, 0xFF, 0x69]) == "h\ufffdi"


def test_byte_tokenizer_eot_is_nul_inside_the_256_byte_vocabulary() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eot_token) == (256, 0)


def test_both_tokenizers_satisfy_the_protocol(gpt2: GPT2Tokenizer) -> None:
    assert isinstance(ByteTokenizer(), Tokenizer)
    assert isinstance(gpt2, Tokenizer)


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_gpt2_tokenizer_from_a_local_ranks_file_round_trips_text(gpt2: GPT2Tokenizer, text: str) -> None:
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_tokenizer_applies_the_merges_of_the_ranks_file(gpt2: GPT2Tokenizer) -> None:
    hello, world = 256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")
    assert gpt2.encode("hello world") == [hello, world]
    assert gpt2.encode("hex") == [256 + MERGES.index(b"he"), ord("x")]


def test_gpt2_tokenizer_treats_endoftext_in_text_as_ordinary_text(gpt2: GPT2Tokenizer) -> None:
    ids = gpt2.encode("<|endoftext|>")
    assert 50256 not in ids
    assert gpt2.decode(ids) == "<|endoftext|>"


def test_gpt2_tokenizer_eot_is_50256_of_a_50257_vocabulary(gpt2: GPT2Tokenizer) -> None:
    assert (gpt2.vocab_size, gpt2.eot_token) == (50257, 50256)
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_gpt2_tokenizer_decodes_ids_its_ranks_file_lacks_to_the_replacement_character(gpt2: GPT2Tokenizer) -> None:
    hello = gpt2.encode("hello")
    assert gpt2.decode([*hello, 40000, *hello, 50256]) == "hello\ufffdhello<|endoftext|>"
    assert gpt2.decode([40000, 40001]) == "\ufffd\ufffd"


def test_gpt2_tokenizer_without_file_or_cache_explains_how_to_provide_one(empty_tiktoken_cache: Path) -> None:
    with pytest.raises(TokenizerUnavailableError) as info:
        GPT2Tokenizer()
    message = str(info.value)
    assert str(empty_tiktoken_cache) in message
    assert "--tokenizer-file" in message
    assert "never downloads" in message
    assert cache_path(empty_tiktoken_cache, R50K_FILE[0]).name in message


def test_gpt2_tokenizer_with_tiktoken_cache_turned_off_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(TokenizerUnavailableError, match=r"cache is turned off"):
        GPT2Tokenizer()


def test_gpt2_tokenizer_with_missing_explicit_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailableError, match=r"gone\.tiktoken: no such file"):
        GPT2Tokenizer(tmp_path / "gone.tiktoken")


def test_corrupt_file_in_tiktoken_cache_is_reported_not_used(empty_tiktoken_cache: Path) -> None:
    _ranks_file(cache_path(empty_tiktoken_cache, R50K_FILE[0]))
    with pytest.raises(TokenizerUnavailableError, match=rf"is corrupt: expected sha256 {R50K_FILE[1]}"):
        GPT2Tokenizer()


def test_cached_ranks_file_is_found_by_the_sha1_of_its_url(tmp_path: Path) -> None:
    url = "https://example.invalid/tiny.tiktoken"
    data = _ranks_file(tmp_path / hashlib.sha1(url.encode()).hexdigest()).read_bytes()
    ranks = find_cached_ranks(tmp_path, single_files=((url, hashlib.sha256(data).hexdigest()),))
    assert ranks is not None
    assert ranks[b"hello"] == 256 + MERGES.index(b"hello")


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's own byte-to-character table (openai/gpt-2 src/encoder.py)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _data_gym_files(directory: Path) -> tuple[Path, Path]:
    """A vocab.bpe / encoder.json pair in GPT-2's original format with MERGES' merges."""
    to_char = _gpt2_bytes_to_unicode()
    encoder = {ch: i for i, ch in enumerate(to_char.values())}
    lines = ["#version: 0.2"]
    for pair in MERGE_PAIRS:
        text = ["".join(to_char[b] for b in part) for part in pair]
        lines.append(" ".join(text))
        encoder["".join(text)] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    (directory / "vocab.bpe").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    return directory / "vocab.bpe", directory / "encoder.json"


def test_data_gym_vocab_conversion_matches_tiktokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    bpe, enc = _data_gym_files(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken reads the local files, caches nothing
    expected = data_gym_to_mergeable_bpe_ranks(str(bpe), str(enc))
    assert data_gym_to_ranks(bpe.read_bytes(), enc.read_bytes(), str(tmp_path)) == expected


def test_cached_data_gym_pair_is_found_by_the_sha1_of_its_urls(tmp_path: Path) -> None:
    bpe, enc = _data_gym_files(tmp_path)
    sources = []
    for path, url in (
        (bpe, "https://example.invalid/vocab.bpe"),
        (enc, "https://example.invalid/encoder.json"),
    ):
        path.rename(cache_path(tmp_path, url))
        sources.append((url, hashlib.sha256(cache_path(tmp_path, url).read_bytes()).hexdigest()))
    ranks = find_cached_ranks(tmp_path, single_files=(), data_gym_pairs=((sources[0], sources[1]),))
    assert ranks is not None
    assert ranks[b" world"] == 256 + MERGES.index(b" world")


def test_ranks_file_lacking_a_single_byte_is_rejected(tmp_path: Path) -> None:
    path = _ranks_file(tmp_path / "holey.tiktoken", skip_byte=65)
    with pytest.raises(TokenizerError, match=r"holey\.tiktoken: every one of the 256 single bytes.*byte 65"):
        GPT2Tokenizer(path)


def test_malformed_ranks_line_is_rejected_naming_file_and_line(tmp_path: Path) -> None:
    path = _ranks_file(tmp_path / "bad.tiktoken")
    path.write_bytes(path.read_bytes() + b"not-base64!! x\n")
    with pytest.raises(TokenizerError, match=r"bad\.tiktoken, line 266: expected 'BASE64TOKEN RANK'"):
        GPT2Tokenizer(path)


def test_get_tokenizer_gives_each_named_tokenizer(tmp_path: Path) -> None:
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    assert isinstance(get_tokenizer("gpt2", _ranks_file(tmp_path / "r.tiktoken")), GPT2Tokenizer)


def test_get_tokenizer_rejects_an_unknown_name_listing_the_known() -> None:
    with pytest.raises(TokenizerError, match=r"unknown tokenizer 'bpe'; expected one of byte, gpt2"):
        get_tokenizer("bpe")


def test_get_tokenizer_byte_rejects_a_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"'byte' reads no file"):
        get_tokenizer("byte", tmp_path / "x")
