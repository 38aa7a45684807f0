"""BluTrain's hand-written CUDA kernels, compiled at first use by NVRTC through CuPy.

One ``.cu`` file per kernel family sits in this folder beside the Python module that launches it
(``_layernorm.py`` beside ``layernorm.cu``, ``llama.py`` beside ``llama.cu``; ``_attention.py`` launches the four
attention sources); each source starts with what it computes, its launch shape and its bytes/FLOPs.
``_core.py`` compiles a family and launches its kernels: the headers the sources include from this folder
(``common.cuh``; the attention families' ``attention.cuh``, and ``wgmma.cuh`` for sm_90a) are pasted into each
source before compilation (rather than found through ``-I``) so that CuPy's on-disk cache, keyed on the source
text, sees a change to a shared header too. ``_plans.py`` holds the device tables of the multi-tensor kernels.
This module re-exports every family's public functions and assembles :data:`KERNELS` and :data:`STANDALONE`
from the families' own tables.

Each public function takes and returns CuPy arrays with the argument order of the op kernel it
implements (see ``blutrain.tensor.ops``), so a device plugin can register it directly. Per-row
statistics that only backward reads (LayerNorm's mean and rstd, the log-sum-exp of cross-entropy
and attention) are float32 whatever the input dtype, as PyTorch keeps them. A function
returns ``None`` when a call is outside what its kernel covers (a dtype other than float32 and
bfloat16, a mask given to attention, an unsupported head dim, an empty tensor, a strided view or a
dtype pair other than float32/bfloat16/float16 given to a cast): the caller then runs the generic
kernel. :data:`KERNELS` lists them by op name; ``_half_elementwise.py`` adds the plain elementwise ops
(arithmetic, comparisons, unary math) for bfloat16 and float16, each one launch computing in float32
registers with the bits of the generic path's widen / float32 op / narrow.

Importing this module does not import CuPy; nothing here runs without a GPU.
"""

from __future__ import annotations

from blutrain.kernels.cuda import (
    _adamw,
    _attention,
    _casts,
    _cross_entropy,
    _embedding,
    _gelu,
    _half_elementwise,
    _layernorm,
    _reduce,
    _scale,
    _softmax,
)
from blutrain.kernels.cuda import llama as llama
from blutrain.kernels.cuda._adamw import ADAMW_TILE, adamw_multi_tensor
from blutrain.kernels.cuda._attention import sdpa, sdpa_backward, sdpa_packed, sdpa_packed_backward
from blutrain.kernels.cuda._casts import CAST_TILE, cast, cast_multi_tensor
from blutrain.kernels.cuda._core import (
    FAMILIES,
    Registry,
    function,
    is_deterministic,
    module,
    set_deterministic,
    sm_count,
    source,
)
from blutrain.kernels.cuda._core import HOPPER_FAMILIES as HOPPER_FAMILIES
from blutrain.kernels.cuda._core import hopper_module as hopper_module
from blutrain.kernels.cuda._cross_entropy import (
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_rows,
    cross_entropy_with_grad,
)
from blutrain.kernels.cuda._embedding import embedding, embedding_backward
from blutrain.kernels.cuda._gelu import bias_gelu, bias_gelu_backward, gelu, gelu_backward
from blutrain.kernels.cuda._gemm_3xtf32 import GEMM_3XTF32_MIN_FLOPS, gemm_3xtf32
from blutrain.kernels.cuda._layernorm import layer_norm, layer_norm_backward, layer_norm_residual
from blutrain.kernels.cuda._philox import PHILOX_PER_COUNTER, philox
from blutrain.kernels.cuda._reduce import sum, sum_cols, sum_rows
from blutrain.kernels.cuda._scale import SCALE_TILE, norm_multi_tensor, scale_multi_tensor
from blutrain.kernels.cuda._softmax import log_softmax, log_softmax_backward, softmax, softmax_backward

# op name -> (fused function, dtype names it handles). The device plugin registers each with a
# priority above the generic kernels and falls back to the generic one when it returns None.
KERNELS: Registry = {
    **_layernorm.KERNELS,
    **_gelu.KERNELS,
    **_cross_entropy.KERNELS,
    **_softmax.KERNELS,
    **_embedding.KERNELS,
    **_reduce.KERNELS,
    **_attention.KERNELS,
    **_casts.KERNELS,
    **llama.KERNELS,
    **_half_elementwise.KERNELS,
}

# Ops with no generic kernel: registered as they are (they never return None for valid input).
STANDALONE: Registry = {
    **_adamw.STANDALONE,
    **_scale.STANDALONE,
    **_casts.STANDALONE,
}

__all__ = [
    "ADAMW_TILE",
    "CAST_TILE",
    "FAMILIES",
    "GEMM_3XTF32_MIN_FLOPS",
    "KERNELS",
    "PHILOX_PER_COUNTER",
    "SCALE_TILE",
    "STANDALONE",
    "adamw_multi_tensor",
    "bias_gelu",
    "bias_gelu_backward",
    "cast",
    "cast_multi_tensor",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_rows",
    "cross_entropy_with_grad",
    "embedding",
    "embedding_backward",
    "function",
    "gelu",
    "gelu_backward",
    "gemm_3xtf32",
    "is_deterministic",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_residual",
    "log_softmax",
    "log_softmax_backward",
    "module",
    "norm_multi_tensor",
    "philox",
    "scale_multi_tensor",
    "sdpa",
    "sdpa_backward",
    "sdpa_packed",
    "sdpa_packed_backward",
    "set_deterministic",
    "sm_count",
    "softmax",
    "softmax_backward",
    "source",
    "sum",
    "sum_cols",
    "sum_rows",
]
