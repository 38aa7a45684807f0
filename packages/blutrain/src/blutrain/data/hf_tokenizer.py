"""A Hugging Face ``tokenizer.json`` (the format of Llama's and most current models' tokenizers) through
the ``tokenizers`` library, an optional dependency (``pip install 'blutrain[hf-tokenizers]'``).

The tokenizer's name is ``hf:`` and the file's absolute path, so ``dataset.json`` and checkpoints that
record it name the file, and ``get_tokenizer`` builds it again from that name. BluTrain never downloads:
the file must be on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from blutrain.data.errors import TokenizerError, TokenizerUnavailableError

HF_PREFIX = "hf:"
# end-of-text markers, most common first: Llama 1/2 and Mistral, GPT-2-style, Llama 3, Gemma
EOT_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """The tokenizer of a ``tokenizer.json``; ``eot_token`` is its first of ``EOT_NAMES`` (or ``eot``)."""

    def __init__(self, path: str | os.PathLike[str], eot: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TokenizerUnavailableError(
                "tokenizer 'hf' reads a Hugging Face tokenizer.json through the tokenizers package, which is not "
                "installed: pip install 'blutrain[hf-tokenizers]' (or pip install tokenizers)") from None
        file = Path(path).resolve()
        if not file.is_file():
            raise TokenizerUnavailableError(f"tokenizer file {file}: no such file; expected a Hugging Face "
                                            "tokenizer.json")
        try:
            self._tok: Any = _Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception subclass for any parse failure
            raise TokenizerError(f"tokenizer file {file}: not a Hugging Face tokenizer.json: {exc}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        names = (eot,) if eot is not None else EOT_NAMES
        found = next((vocab[n] for n in names if n in vocab), None)
        if found is None:
            raise TokenizerError(f"tokenizer file {file}: none of {', '.join(names)} is in its vocabulary; it needs "
                                 "an end-of-text token to separate documents")
        self.path = file
        self.eot_token: int = int(found)
        self.vocab_size: int = max(int(self._tok.get_vocab_size(with_added_tokens=True)), max(vocab.values()) + 1)

    @property
    def name(self) -> str:
        return HF_PREFIX + str(self.path)

    def encode(self, text: str) -> list[int]:
        # no special tokens added: prepare puts eot before each document itself
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tok.decode(tokens, skip_special_tokens=False))


__all__ = ["EOT_NAMES", "HF_PREFIX", "HFTokenizer"]
