"""blutrain.tensor: the typed tensor, op dispatch, the plugin system and the NumPy CPU backend."""

from blutrain.tensor import plugins
from blutrain.tensor.backend import Backend, BackendRegistry, Generator, array_module, backends, get_backend
from blutrain.tensor.device import Device, device
from blutrain.tensor.dtype import (
    ALL_DTYPES,
    FLOATING_DTYPES,
    DType,
    as_dtype,
    bfloat16,
    bool_,
    float16,
    float32,
    float64,
    get_default_dtype,
    int8,
    int16,
    int32,
    int64,
    promote_types,
    set_default_dtype,
    uint8,
)
from blutrain.tensor.errors import (
    AutogradError,
    BluTrainError,
    DeviceMismatchError,
    KernelNotFoundError,
    NotRegisteredError,
    PluginError,
    ShapeError,
    TensorIndexError,
    TensorTypeError,
    TensorValueError,
)
from blutrain.tensor.kernel import KernelRegistry, kernels
from blutrain.tensor.ops.elementwise import (
    abs,
    add,
    clamp,
    cos,
    div,
    eq,
    erf,
    exp,
    expm1,
    ge,
    gelu,
    gt,
    le,
    log,
    log1p,
    logical_and,
    logical_not,
    logical_or,
    lt,
    masked_fill,
    maximum,
    minimum,
    mul,
    ne,
    neg,
    pow,
    relu,
    result_type,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    sqrt,
    sub,
    tanh,
    where,
)
from blutrain.tensor.ops.factory import (
    arange,
    empty,
    empty_like,
    eye,
    full,
    full_like,
    linspace,
    manual_seed,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randint_like,
    randn,
    randn_like,
    tensor,
    zeros,
    zeros_like,
)
from blutrain.tensor.ops.indexing import gather, index_add, index_put_, index_select, one_hot, scatter_add, tril, triu
from blutrain.tensor.ops.linalg import bmm, linear, matmul
from blutrain.tensor.ops.nn import (
    cross_entropy,
    dropout,
    embedding,
    layer_norm,
    rms_norm,
    scaled_dot_product_attention,
)
from blutrain.tensor.ops.reduction import (
    amax,
    amin,
    argmax,
    argmin,
    log_softmax,
    logsumexp,
    mean,
    norm,
    softmax,
    std,
    sum,
    var,
)
from blutrain.tensor.ops.shape import cat, stack
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.registry import Provider, Registry
from blutrain.tensor.serialization import load_file, save_file
from blutrain.tensor.tensor import Storage, Tensor, from_dlpack, from_numpy

bool = bool_
float = float32
half = float16
double = float64
long = int64

__all__ = [
    "ALL_DTYPES", "FLOATING_DTYPES", "AutogradError", "Backend", "BackendRegistry", "BluTrainError", "DType",
    "Device", "DeviceMismatchError", "Generator", "KernelNotFoundError", "KernelRegistry", "NotRegisteredError",
    "PluginError", "Provider", "Registry", "ShapeError", "Storage", "Tensor", "TensorIndexError", "TensorTypeError",
    "TensorValueError", "abs", "add", "amax", "amin", "arange", "argmax", "argmin", "array_module", "as_dtype",
    "backends", "bfloat16", "bmm", "bool", "bool_", "cat", "clamp", "cos", "cross_entropy", "device", "div",
    "double", "dropout", "embedding", "empty", "empty_like", "eq", "erf", "exp", "expm1", "eye", "float",
    "float16", "float32", "float64", "from_dlpack", "from_numpy", "full", "full_like", "gather", "ge", "gelu",
    "get_backend", "get_default_dtype", "gt", "half", "hookimpl", "index_add", "index_put_", "index_select",
    "int8", "int16", "int32", "int64", "kernels", "layer_norm", "le", "linear", "linspace", "load_file", "log",
    "log1p", "log_softmax", "logical_and", "logical_not", "logical_or", "logsumexp", "long", "lt",
    "manual_seed", "masked_fill", "matmul", "maximum", "mean", "minimum", "mul", "ne", "neg", "norm",
    "one_hot", "ones", "ones_like", "plugins", "pow", "promote_types", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "relu", "result_type", "rms_norm", "rsqrt", "save_file",
    "scaled_dot_product_attention", "scatter_add", "set_default_dtype", "sigmoid", "sign", "silu", "sin",
    "softmax", "sqrt", "stack", "std", "sub", "sum", "tanh", "tensor", "tril", "triu", "uint8", "var",
    "where", "zeros", "zeros_like",
]
