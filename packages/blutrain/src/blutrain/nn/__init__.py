"""blutrain.nn: modules (parameters, buffers, submodules, state dicts, hooks) and the layers of GPT-2 and
Llama-style models."""

from blutrain.nn import functional, init
from blutrain.nn.activation import GELU, Dropout
from blutrain.nn.attention import AttentionCore, CausalSelfAttention, attend_cached
from blutrain.nn.container import ModuleList, Sequential
from blutrain.nn.embedding import Embedding
from blutrain.nn.errors import ModuleError, StateDictError
from blutrain.nn.kv_cache import KVCache
from blutrain.nn.linear import Linear
from blutrain.nn.module import LoadResult, Module, RemovableHandle
from blutrain.nn.normalization import LayerNorm, RMSNorm
from blutrain.nn.parameter import Parameter

__all__ = ["GELU", "AttentionCore", "CausalSelfAttention", "Dropout", "Embedding", "KVCache", "LayerNorm", "Linear",
           "LoadResult", "Module", "ModuleError", "ModuleList", "Parameter", "RMSNorm", "RemovableHandle", "Sequential",
           "StateDictError", "attend_cached", "functional", "init"]
