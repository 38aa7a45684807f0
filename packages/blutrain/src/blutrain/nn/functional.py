"""The functional ops layers are built from, re-exported from blutrain.tensor (one implementation)."""

from blutrain.tensor import (
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    linear_cross_entropy,
    log_softmax,
    one_hot,
    relu,
    rms_norm,
    scaled_dot_product_attention,
    sigmoid,
    silu,
    softmax,
    tanh,
)

__all__ = ["cross_entropy", "dropout", "embedding", "gelu", "layer_norm", "linear", "linear_cross_entropy",
           "log_softmax", "one_hot", "relu", "rms_norm", "scaled_dot_product_attention", "sigmoid", "silu", "softmax",
           "tanh"]
