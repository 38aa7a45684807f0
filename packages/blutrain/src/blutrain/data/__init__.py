"""blutrain.data: token shards, the token loader, tokenizers, `prepare` and the built-in corpus.

Depends on NumPy only (tiktoken for the gpt2 tokenizer, imported when one is made). Batches are
NumPy int64 arrays; the trainer turns them into tensors.
"""

from blutrain.data.corpus import DEFAULT_MAX_BYTES, cache_root, stdlib_corpus
from blutrain.data.errors import (
    CorpusError,
    DataError,
    LoaderError,
    PrepareError,
    ShardError,
    TokenizerError,
    TokenizerUnavailableError,
)
from blutrain.data.hf_tokenizer import HFTokenizer
from blutrain.data.loader import TokenLoader, find_shards
from blutrain.data.prepare import (
    PrepareReport,
    add_prepare_command,
    prepare,
    run_prepare_command,
    unigram_entropy_nats,
)
from blutrain.data.shard import SHARD_MAGIC, SHARD_VERSION, read_shard, write_shard
from blutrain.data.tokenizer import ByteTokenizer, GPT2Tokenizer, Tokenizer, get_tokenizer

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SHARD_MAGIC",
    "SHARD_VERSION",
    "ByteTokenizer",
    "CorpusError",
    "DataError",
    "GPT2Tokenizer",
    "HFTokenizer",
    "LoaderError",
    "PrepareError",
    "PrepareReport",
    "ShardError",
    "TokenLoader",
    "Tokenizer",
    "TokenizerError",
    "TokenizerUnavailableError",
    "add_prepare_command",
    "cache_root",
    "find_shards",
    "get_tokenizer",
    "prepare",
    "read_shard",
    "run_prepare_command",
    "stdlib_corpus",
    "unigram_entropy_nats",
    "write_shard",
]
