"""Embedding: rows of a (num_embeddings, embedding_dim) table picked by integer indices."""

from __future__ import annotations

from blutrain.nn import init
from blutrain.nn.linear import _positive
from blutrain.nn.module import Module
from blutrain.nn.parameter import Parameter
from blutrain.tensor import DType, Tensor, embedding, empty
from blutrain.tensor.device import Device


class Embedding(Module):
    """``weight`` (num_embeddings, embedding_dim), initialised N(0, 1) as PyTorch's."""

    weight: Parameter

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device: str | Device | None = None,
                 dtype: DType | str | None = None) -> None:
        super().__init__()
        self.num_embeddings = _positive("Embedding: num_embeddings", num_embeddings)
        self.embedding_dim = _positive("Embedding: embedding_dim", embedding_dim)
        weight = empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight = Parameter(init.normal_(weight))

    def forward(self, idx: Tensor) -> Tensor:
        return embedding(idx, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


__all__ = ["Embedding"]
