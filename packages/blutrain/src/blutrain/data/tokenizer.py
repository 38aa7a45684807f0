"""Tokenizers: the byte-level one and GPT-2's BPE, behind one small Protocol.

GPT-2's BPE runs on ``tiktoken``, but BluTrain builds the ``tiktoken.Encoding`` itself from a ranks
file on this machine, so tiktoken's downloading code is never reached. The file comes from an
explicit path (``--tokenizer-file``) or from tiktoken's own cache, where an earlier
``tiktoken.get_encoding("gpt2")`` or ``get_encoding("r50k_base")`` (for example by an llm.c or
modded-nanogpt data script) left it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from blutrain.data.errors import TokenizerError, TokenizerUnavailableError

if TYPE_CHECKING:
    import tiktoken


@runtime_checkable
class Tokenizer(Protocol):
    """What `prepare` and the trainer need of a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids, eot included; every id is in ``range(vocab_size)``."""
        ...

    @property
    def eot_token(self) -> int:
        """The id that separates documents (`prepare` puts it before each one, as llm.c does)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no training, no files.

    The end-of-text token is byte 0 (NUL). It needs no id beyond the 256 bytes, so the vocabulary
    stays 256, and NUL does not occur in text files — git and grep take a NUL as the sign of a
    binary file — so the marker is unambiguous in any text corpus (the stdlib corpus skips the
    rare file that has one). A printable separator such as a newline would collide with the text.
    """

    name = "byte"
    vocab_size = 256
    eot_token = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


# GPT-2's split pattern, as tiktoken writes it (tiktoken_ext/openai_public.py, r50k_pat_str); the
# original release's pattern is equivalent but slower.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257

_OPENAI = "https://openaipublic.blob.core.windows.net"
# (URL, sha256) of the files tiktoken caches for GPT-2's ranks, from tiktoken_ext/openai_public.py.
# r50k_base has exactly GPT-2's ranks in one file; "gpt2" keeps them as the original vocab.bpe and
# encoder.json pair.
R50K_FILE = (
    f"{_OPENAI}/encodings/r50k_base.tiktoken",
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
)
GPT2_VOCAB_BPE = (
    f"{_OPENAI}/gpt-2/encodings/main/vocab.bpe",
    "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
)
GPT2_ENCODER_JSON = (
    f"{_OPENAI}/gpt-2/encodings/main/encoder.json",
    "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
)


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken caches encoding files (tiktoken/load.py ``read_file_cached``); None when
    ``TIKTOKEN_CACHE_DIR`` is set to the empty string, which turns its cache off."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            value = os.environ[var]
            return Path(value) if value else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def cache_path(cache_dir: Path, url: str) -> Path:
    """The file tiktoken caches ``url`` as: named by the sha1 of the URL."""
    return cache_dir / hashlib.sha1(url.encode()).hexdigest()


def parse_tiktoken_ranks(data: bytes, source: str) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` ranks file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank_text = line.split()
            token = base64.b64decode(token_b64, validate=True)
            rank = int(rank_text)
        except (ValueError, binascii.Error):
            raise TokenizerError(
                f"ranks file {source}, line {number}: expected 'BASE64TOKEN RANK', received {line[:80]!r}"
            ) from None
        ranks[token] = rank
    return ranks


def data_gym_to_ranks(vocab_bpe: bytes, encoder_json: bytes, source: str) -> dict[bytes, int]:
    """Turn GPT-2's original ``vocab.bpe`` + ``encoder.json`` into tiktoken ranks.

    The same conversion as tiktoken's ``data_gym_to_mergeable_bpe_ranks``, on bytes already read, so
    no URL is ever handed to tiktoken. GPT-2 writes each byte as a printable character: printable
    non-space bytes as themselves, the other 68 as chr(256 + n) in byte order.
    """
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    char_to_byte = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in char_to_byte.values()]
    char_to_byte.update({chr(256 + n): b for n, b in enumerate(others)})

    def decode(word: str) -> bytes:
        return bytes(char_to_byte[c] for c in word)

    ranks = {bytes([b]): rank for rank, b in enumerate(printable + others)}
    try:
        for line in vocab_bpe.decode("utf-8").split("\n")[1:-1]:
            first, second = line.split()
            ranks[decode(first) + decode(second)] = len(ranks)
        encoder = {decode(k): v for k, v in json.loads(encoder_json).items()}
    except (ValueError, KeyError) as e:
        raise TokenizerError(f"GPT-2 vocab.bpe / encoder.json in {source} cannot be read: {e}") from None
    encoder.pop(b"<|endoftext|>", None)
    encoder.pop(b"<|startoftext|>", None)
    if encoder != ranks:
        raise TokenizerError(
            f"GPT-2 vocab.bpe and encoder.json in {source} disagree: "
            f"{len(ranks)} merged ranks vs {len(encoder)} encoder entries"
        )
    return ranks


def _read_verified(path: Path, sha256: str) -> bytes | None:
    """The file's bytes if it exists; a mismatching hash is an error, not a silent wrong tokenizer."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise TokenizerUnavailableError(
            f"tiktoken cache file {path} is corrupt: expected sha256 {sha256}, received {digest}; "
            "delete it and provide the file again (--tokenizer-file PATH)"
        )
    return data


def find_cached_ranks(
    cache_dir: Path,
    single_files: tuple[tuple[str, str], ...] = (R50K_FILE,),
    data_gym_pairs: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
        (GPT2_VOCAB_BPE, GPT2_ENCODER_JSON),
    ),
) -> dict[bytes, int] | None:
    """GPT-2's ranks from tiktoken's cache in ``cache_dir``, or None if it holds none of the files.

    ``single_files`` are (URL, sha256) of ``.tiktoken`` files; ``data_gym_pairs`` of vocab.bpe and
    encoder.json pairs. Every file found is checked against its sha256, as tiktoken does.
    """
    for url, sha in single_files:
        data = _read_verified(cache_path(cache_dir, url), sha)
        if data is not None:
            return parse_tiktoken_ranks(data, url)
    for (bpe_url, bpe_sha), (json_url, json_sha) in data_gym_pairs:
        bpe = _read_verified(cache_path(cache_dir, bpe_url), bpe_sha)
        enc = _read_verified(cache_path(cache_dir, json_url), json_sha)
        if bpe is not None and enc is not None:
            return data_gym_to_ranks(bpe, enc, str(cache_dir))
    return None


def _unavailable_message(cache_dir: Path | None) -> str:
    where = (
        "tiktoken's cache is turned off (TIKTOKEN_CACHE_DIR is empty)"
        if cache_dir is None
        else (
            f"tiktoken's cache {cache_dir} holds neither r50k_base.tiktoken (as "
            f"{cache_path(cache_dir, R50K_FILE[0]).name}) nor GPT-2's vocab.bpe + encoder.json (as "
            f"{cache_path(cache_dir, GPT2_VOCAB_BPE[0]).name}, "
            f"{cache_path(cache_dir, GPT2_ENCODER_JSON[0]).name})"
        )
    )
    return (
        f"the gpt2 tokenizer needs GPT-2's BPE ranks, and no ranks file was given; {where}. "
        "BluTrain never downloads. Either pass --tokenizer-file PATH (a .tiktoken ranks file such as "
        f"{R50K_FILE[0]}, fetched on a machine with network), or fill tiktoken's cache there by running "
        "python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\" with the same TIKTOKEN_CACHE_DIR "
        "and copying the directory here."
    )


def _check_gpt2_ranks(ranks: dict[bytes, int], source: str) -> None:
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"ranks file {source}: every one of the 256 single bytes must have a rank; "
            f"{len(missing)} do not (first: byte {missing[0]})"
        )
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"ranks file {source}: ranks must be distinct, some are repeated")
    top = max(ranks.values())
    if min(ranks.values()) < 0 or top >= GPT2_EOT:
        raise TokenizerError(
            f"ranks file {source}: ranks must lie in [0, {GPT2_EOT - 1}] to leave {GPT2_EOT} to "
            f"<|endoftext|>, received ranks up to {top}"
        )


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50257 ids, ``<|endoftext|>`` = 50256) through tiktoken.

    ``ranks_file``: a ``.tiktoken`` ranks file (base64 token and rank per line). Without it the
    ranks come from tiktoken's cache; if neither has them, :class:`TokenizerUnavailableError`.
    A ranks file with fewer merges than GPT-2's (a test vocabulary) still works: ids it lacks are
    never produced by encode and decode to U+FFFD, and eot stays 50256.
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_token = GPT2_EOT

    def __init__(self, ranks_file: str | os.PathLike[str] | None = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerUnavailableError(
                "the gpt2 tokenizer needs the tiktoken package, which is not installed: pip install tiktoken"
            ) from None
        if ranks_file is not None:
            path = Path(ranks_file)
            if not path.is_file():
                raise TokenizerUnavailableError(
                    f"tokenizer file {path}: no such file; expected a .tiktoken BPE ranks file "
                    f"(base64 token and rank per line, e.g. {R50K_FILE[0]})"
                )
            source = str(path)
            ranks = parse_tiktoken_ranks(path.read_bytes(), source)
        else:
            cache_dir = tiktoken_cache_dir()
            found = find_cached_ranks(cache_dir) if cache_dir is not None else None
            if found is None:
                raise TokenizerUnavailableError(_unavailable_message(cache_dir))
            source, ranks = str(cache_dir), found
        _check_gpt2_ranks(ranks, source)
        self.source = source
        self._known_ids = frozenset(ranks.values()) | {GPT2_EOT}
        self._encoding: tiktoken.Encoding = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": GPT2_EOT},
        )

    def encode(self, text: str) -> list[int]:
        # Ordinary: "<|endoftext|>" inside a document is text, as in llm.c's data scripts.
        return self._encoding.encode_ordinary(text)

    def decode(self, tokens: list[int]) -> str:
        """The text of ``tokens``; an id the ranks file lacks (a model samples any id of its vocabulary,
        and a test vocabulary has few) decodes to U+FFFD, as undecodable bytes do."""
        known = self._known_ids
        if all(t in known for t in tokens):
            return self._encoding.decode(tokens, errors="replace")
        parts: list[str] = []
        run: list[int] = []
        for t in tokens:
            if t in known:
                run.append(t)
                continue
            parts += [self._encoding.decode(run, errors="replace"), "\ufffd"]
            run = []
        parts.append(self._encoding.decode(run, errors="replace"))
        return "".join(parts)


TOKENIZER_NAMES = ("byte", "gpt2")


def get_tokenizer(name: str, path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The tokenizer called ``name`` ("byte" or "gpt2"); ``path`` is gpt2's ranks file."""
    if name == "byte":
        if path is not None:
            raise TokenizerError(f"tokenizer 'byte' reads no file, received path {path}")
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(path)
    raise TokenizerError(f"unknown tokenizer {name!r}; expected one of {', '.join(TOKENIZER_NAMES)}")
