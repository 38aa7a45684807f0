"""The Tensor: a view (shape, strides, offset) of a storage, with a dtype, a device and autograd state.

The backend array held in ``array`` *is* the view: NumPy and CuPy arrays already carry shape,
strides and offset over a shared buffer, so a view op is the array module's own view plus a new
Tensor that shares the :class:`Storage` (and with it the version counter). The view methods are
:class:`~blutrain.tensor.views.ViewMethods` (mixed in; they need ``_view_op`` from this class); arithmetic,
reductions and the rest live in :mod:`blutrain.tensor.ops`; this file holds construction, metadata,
conversions and the autograd entry points.
A method whose op function takes the tensor first with the method's own parameters is that function
(``mean = _rd.mean``): calling it costs no forwarding frame. The op modules never import this file
(see :mod:`blutrain.tensor.base`).
"""

from __future__ import annotations

import builtins

# In Tensor's signatures, ``int``/``float``/``bool`` would name its methods of those names (as in
# PyTorch's stubs, which use the same aliases).
from builtins import bool as _bool
from builtins import float as _float
from builtins import int as _int
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from blutrain.tensor import dispatch
from blutrain.tensor.base import Scalar, TensorBase, _normalize_dim, _shape_arg
from blutrain.tensor.device import Device, device
from blutrain.tensor.dtype import DTYPE_NAMES, DType, as_dtype, from_numpy_dtype
from blutrain.tensor.errors import (
    AutogradError,
    ShapeError,
    TensorTypeError,
    TensorValueError,
)
from blutrain.tensor.ops import elementwise as _ew
from blutrain.tensor.ops import indexing as _ix
from blutrain.tensor.ops import linalg as _la
from blutrain.tensor.ops import reduction as _rd
from blutrain.tensor.ops import shape as _sh
from blutrain.tensor.views import ViewMethods

_new_object = object.__new__


class Storage:
    """The buffer shared by a tensor and all its views, and their common version counter.

    ``version`` goes up with every in-place write; autograd compares it with the value seen when a
    tensor was saved for backward, which is how a stale saved tensor is detected.
    """

    __slots__ = ("__weakref__", "array", "device", "version")  # weak: autograd's engine tracks storages

    def __init__(self, array: Any, device: Device) -> None:
        self.array = array
        self.device = device
        self.version = 0


class Tensor(ViewMethods, TensorBase):
    """An n-dimensional array on a device, with reverse-mode autograd state."""

    __slots__ = (
        "__weakref__",
        "_base",
        "_retains_grad",
        "_rg",
        "array",
        "device",
        "dtype",
        "grad",
        "grad_fn",
        "grad_hooks",
        "output_nr",
        "post_accumulate_grad_hooks",
        "storage",
    )

    # The backend array this tensor views (a NumPy array on the CPU): its shape, strides and memory; the array a
    # kernel takes (blutrain.tensor.dispatch.call passes it). A plain slot, read on every op; read-only by contract
    # (capture.substitute_arrays swaps it for a tracer). Writing *into* it goes around the ops: the writer calls
    # bump_version() after it, and under blutrain.compiler the write must be a kernel or go through capture.
    array: Any
    # The Storage shared by this tensor and all its views (``a.storage is b.storage``: the same memory and
    # version counter). A plain slot, read on autograd's per-op path; never assigned outside this class (the
    # ``data`` setter re-points a tensor).
    storage: Storage
    _base: Tensor | None
    dtype: DType
    device: Device
    _rg: bool
    grad: Tensor | None
    grad_fn: Any
    output_nr: int
    # The hooks register_hook / register_post_accumulate_grad_hook added, in order: () until the first one. Plain
    # slots that the autograd engine reads for every leaf; added to only through those two methods.
    grad_hooks: Sequence[Callable[[Tensor], Tensor | None]]
    post_accumulate_grad_hooks: Sequence[Callable[[Tensor], None]]
    _retains_grad: bool

    __array_priority__ = 1000  # make NumPy defer to Tensor's reflected operators

    def __init__(self, data: Any, *, dtype: DType | str | None = None, device: str | Device | None = None,
                 requires_grad: _bool = False, copy: _bool = True) -> None:
        """``Tensor(data)`` copies ``data`` (nested lists, scalars, NumPy arrays) like ``tensor()``.

        With ``copy=False`` a ``data`` that is a Tensor already of the asked dtype and device is not copied:
        the new tensor shares its storage and version counter (as ``detach()`` does, and as a subclass
        such as ``blutrain.nn.Parameter`` wraps a tensor); anything else is converted as with ``copy=True``.
        """
        if not copy and isinstance(data, Tensor) and (dtype is None or as_dtype(dtype) is data.dtype) and (
                device is None or globals()["device"](device) is data.device):
            self._init(data.array, data.dtype, data.device, data.storage, data._base)
        else:
            t = as_tensor_data(data, dtype=dtype, device=device)
            self._init(t.array, t.dtype, t.device, Storage(t.array, t.device), None)
        if requires_grad:
            self.requires_grad_(True)

    # -- construction -------------------------------------------------------------------------
    def _init(self, data: Any, dtype: DType, dev: Device, storage: Storage, base: Tensor | None) -> None:
        self.array = data
        self.dtype = dtype
        self.device = dev
        self.storage = storage
        self._base = base
        self._rg = False
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.grad_hooks = ()
        self.post_accumulate_grad_hooks = ()
        self._retains_grad = False

    @staticmethod
    def from_array(array: Any, dtype: DType, device: Device) -> Tensor:
        """Wrap a backend array (NumPy on the CPU; what a kernel returns) as a new Tensor of ``dtype`` on
        ``device``, with its own storage; no copy, no check: the array must hold ``dtype``'s values on
        ``device``, and nothing else may keep writing it.
        :func:`blutrain.tensor.dispatch.call` wraps a kernel's outputs this way.

        Called once per op: plain attribute stores, no __init__ (Tensor.__init__ copies its input).
        """
        t: Tensor = _new_object(Tensor)
        t.array = array
        t.dtype = dtype
        t.device = device
        t.storage = Storage(array, device)
        t._base = None
        t._rg = False
        t.grad = None
        t.grad_fn = None
        t.output_nr = 0
        t.grad_hooks = ()
        t.post_accumulate_grad_hooks = ()
        t._retains_grad = False
        return t

    _make = from_array  # the name the op modules call (blutrain.tensor.base)

    @property
    def base(self) -> Tensor | None:
        """The tensor this one is a view of, or None when it owns its storage (PyTorch's ``_base``)."""
        return self._base

    def _view(self, data: Any) -> Tensor:
        """A Tensor over ``data``, a view of this tensor's array: same storage, same version counter."""
        t = Tensor.__new__(Tensor)
        t.array = data
        t.dtype = self.dtype
        t.device = self.device
        t.storage = self.storage
        t._base = self._base if self._base is not None else self
        t._rg = False
        t.grad = None
        t.grad_fn = None
        t.output_nr = 0
        t.grad_hooks = ()
        t.post_accumulate_grad_hooks = ()
        t._retains_grad = False
        return t

    def _view_op(self, op: str, data: Any, attrs: dict[str, Any]) -> Tensor:
        out = self._view(data)
        if self._rg and dispatch.recorder is not None:
            dispatch.recorder(op, (self,), out, attrs)
        return out

    # -- metadata ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[_int, ...]:
        return self.array.shape  # type: ignore[no-any-return]

    def size(self, dim: _int | None = None) -> tuple[_int, ...] | _int:
        if dim is None:
            return self.array.shape  # type: ignore[no-any-return]
        return self.array.shape[_normalize_dim(dim, self.ndim)]  # type: ignore[no-any-return]

    @property
    def ndim(self) -> _int:
        return self.array.ndim  # type: ignore[no-any-return]

    def dim(self) -> _int:
        return self.array.ndim  # type: ignore[no-any-return]

    def numel(self) -> _int:
        return self.array.size  # type: ignore[no-any-return]

    def element_size(self) -> _int:
        return self.dtype.itemsize

    @property
    def itemsize(self) -> _int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> _int:
        return self.numel() * self.dtype.itemsize

    def stride(self, dim: _int | None = None) -> tuple[_int, ...] | _int:
        """Strides in elements, as PyTorch reports them."""
        strides: tuple[_int, ...] = tuple(s // self.dtype.itemsize for s in self.array.strides)
        if dim is None:
            return strides
        return strides[_normalize_dim(dim, self.ndim)]

    def storage_offset(self) -> _int:
        """Offset of the first element from the start of the storage, in elements."""
        backend = self.device.backend
        offset: _int = backend.data_ptr(self.array) - backend.data_ptr(self.storage.array)
        return offset // self.dtype.itemsize

    def data_ptr(self) -> _int:
        return self.device.backend.data_ptr(self.array)

    def is_contiguous(self) -> _bool:
        return bool(self.array.flags.c_contiguous)

    @property
    def is_leaf(self) -> _bool:
        return self.grad_fn is None

    @property
    def is_cuda(self) -> _bool:
        return self.device.type == "cuda"

    @property
    def is_floating_point(self) -> _bool:
        return self.dtype.is_floating

    @property
    def requires_grad(self) -> _bool:
        return self._rg

    @requires_grad.setter
    def requires_grad(self, value: _bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: _bool = True) -> Tensor:
        """Mark a leaf as needing gradients (floating dtypes only)."""
        if requires_grad:
            if not self.dtype.is_floating:
                raise TensorTypeError(
                    f"requires_grad: only floating tensors can require gradients, got dtype {self.dtype.name}")
            _ensure_autograd()
        elif self.grad_fn is not None:
            raise AutogradError("requires_grad_(False) on a non-leaf tensor; use detach() instead")
        self._rg = bool(requires_grad)
        return self

    @property
    def version(self) -> _int:
        """The storage's version counter: bumped by every in-place write to this tensor or a view."""
        return self.storage.version

    def bump_version(self) -> None:
        """Record an in-place write that went around the ops (a collective or a multi-tensor kernel writing
        :attr:`array`), so that autograd notices a saved tensor it changed."""
        self.storage.version += 1

    # -- views (the others are ViewMethods'; t() returns self itself for fewer than 2 dims) ----------------
    def t(self) -> Tensor:
        if self.ndim > 2:
            raise ShapeError(f"t: expects a tensor with at most 2 dims, got shape {list(self.shape)}")
        return self if self.ndim < 2 else self.transpose(0, 1)

    __getitem__ = _ix.getitem
    __setitem__ = _ix.setitem

    # -- copies and conversions ----------------------------------------------------------------
    def contiguous(self) -> Tensor:
        return self if self.array.flags.c_contiguous else _ew.copy(self)

    clone = _ew.copy

    def detach(self) -> Tensor:
        """The same data (shared storage and version counter), cut from the graph.

        The result does not point back at ``self`` as its base: autograd saves outputs detached,
        and a saved tensor referring to the output that refers to the node would be a cycle that
        only the garbage collector could free.
        """
        out = self._view(self.array)
        out._base = self._base
        return out

    def detach_(self) -> Tensor:
        self.grad_fn = None
        self._rg = False
        return self

    @property
    def data(self) -> Tensor:
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        """Point this tensor at ``value``'s storage (any shape, dtype, device), keeping its identity and
        autograd state (requires_grad, .grad, hooks), as ``p.data = ...`` does in PyTorch."""
        if not isinstance(value, Tensor):
            raise TensorTypeError(f"data: expected a Tensor, got {type(value).__name__}")
        self.array = value.array
        self.dtype = value.dtype
        self.device = value.device
        self.storage = value.storage
        self._base = value._base

    def to(self, *args: Any, dtype: DType | str | None = None, device: str | Device | None = None,
           copy: _bool = False) -> Tensor:
        """``to(device)``, ``to(dtype)``, ``to(device, dtype)`` or keywords; no-op when nothing changes."""
        for a in args:
            if isinstance(a, DType) or (isinstance(a, str) and a in DTYPE_NAMES):
                dtype = a
            elif isinstance(a, (str, Device)):
                device = a
            elif isinstance(a, Tensor):
                dtype, device = a.dtype, a.device
            else:
                raise TensorTypeError(f"to: expected a device, a dtype or a tensor, got {a!r}")
        out = self
        if device is not None:
            dev = globals()["device"](device)
            if dev is not out.device:
                out = _ew.to_device(out, dev)
        if dtype is not None:
            dt = as_dtype(dtype)
            if dt is not out.dtype:
                out = _ew.cast(out, dt)
        if copy and out is self:
            out = self.clone()
        return out

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self, index: _int | None = None) -> Tensor:
        return self.to(device("cuda", index))

    def float(self) -> Tensor:
        return self.to(dtype="float32")

    def double(self) -> Tensor:
        return self.to(dtype="float64")

    def half(self) -> Tensor:
        return self.to(dtype="float16")

    def bfloat16(self) -> Tensor:
        return self.to(dtype="bfloat16")

    def long(self) -> Tensor:
        return self.to(dtype="int64")

    def int(self) -> Tensor:
        return self.to(dtype="int32")

    def bool(self) -> Tensor:
        return self.to(dtype="bool")

    def type_as(self, other: Tensor) -> Tensor:
        return self.to(dtype=other.dtype)

    def numpy(self) -> np.ndarray[Any, Any]:
        """The CPU array, sharing memory as PyTorch's does; a CUDA tensor must be copied first."""
        if self.device.type != "cpu":
            raise TensorTypeError(f"numpy: tensor is on {self.device}; call .cpu() first")
        if self._rg:
            raise AutogradError("numpy: tensor requires grad; call .detach().numpy()")
        return self.array  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        host = self.device.backend.to_host(self.array)
        return host if dtype is None else host.astype(dtype)

    def item(self) -> Scalar:
        if self.numel() != 1:
            raise TensorValueError(
                f"item: only a one-element tensor converts to a scalar, got shape {list(self.shape)}")
        return self.device.backend.to_host(self.array).reshape(()).item()  # type: ignore[no-any-return]

    def tolist(self) -> Any:
        return self.device.backend.to_host(self.array).tolist()

    def __float__(self) -> _float:
        return float(self.item())

    def __int__(self) -> _int:
        return builtins.int(self.item())

    def __bool__(self) -> _bool:
        return builtins.bool(self.item())

    def __index__(self) -> _int:
        if self.dtype.is_floating or self.numel() != 1:
            raise TensorTypeError(f"__index__: only one-element integer tensors can be used as an index, got "
                                  f"dtype {self.dtype.name} and shape {list(self.shape)}")
        return builtins.int(self.item())

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rg:
            raise AutogradError("__dlpack__: tensor requires grad; export .detach() instead")
        try:
            return self.array.__dlpack__(*args, **kwargs)
        except BufferError as exc:
            raise TensorTypeError(f"__dlpack__: a {self.dtype.name} tensor on {self.device} cannot be exported "
                                  f"({exc}); convert it first, e.g. .float()") from None

    def __dlpack_device__(self) -> tuple[_int, _int]:
        return self.array.__dlpack_device__()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        host = self.device.backend.to_host(self.array)
        if self.dtype.name == "bfloat16":
            host = host.astype(np.float32)
        body = np.array2string(host, separator=", ", precision=4, prefix="tensor(")
        extras = []
        if self.device.type != "cpu":
            extras.append(f"device='{self.device}'")
        if self.dtype.name not in ("float32", "int64", "bool"):
            extras.append(f"dtype={self.dtype!r}")
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{self.grad_fn.name()}>")
        elif self._rg:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    __hash__ = object.__hash__

    # -- autograd entry points (implemented by blutrain.autograd) --------------------------------
    def backward(self, gradient: Tensor | None = None, retain_graph: _bool = False,
                 create_graph: _bool = False, inputs: Sequence[Tensor] | None = None) -> None:
        _ensure_autograd().backward(self, gradient, retain_graph=retain_graph, create_graph=create_graph,
                                    inputs=inputs)

    def set_grad_fn(self, node: Any, output_nr: _int) -> None:
        """Make this tensor output ``output_nr`` of the autograd node ``node``: it requires grad from now on and
        its gradient flows into ``node``. The autograd engine calls it for each floating output of an op it
        records; ``grad_fn`` and ``output_nr`` read the link back."""
        self._rg = True
        self.grad_fn = node
        self.output_nr = output_nr

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> Callable[[], None]:
        """Call ``hook(grad)`` when this tensor's gradient is computed; it may return a new grad."""
        if not self._rg:
            raise AutogradError("register_hook: the tensor does not require grad")
        hooks = self.grad_hooks if isinstance(self.grad_hooks, list) else []
        hooks.append(hook)
        self.grad_hooks = hooks
        if self.grad_fn is not None:
            self.grad_fn.add_tensor_hook(self.output_nr, hook)

        def remove() -> None:
            if hook in hooks:
                hooks.remove(hook)
            if self.grad_fn is not None:
                self.grad_fn.remove_tensor_hook(self.output_nr, hook)
        return remove

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> Callable[[], None]:
        """Call ``hook(tensor)`` after a leaf's ``.grad`` has been accumulated (gradient ready)."""
        if self.grad_fn is not None:
            raise AutogradError("register_post_accumulate_grad_hook: only leaf tensors have this hook")
        if not self._rg:
            raise AutogradError("register_post_accumulate_grad_hook: the tensor does not require grad")
        hooks = self.post_accumulate_grad_hooks if isinstance(self.post_accumulate_grad_hooks, list) else []
        hooks.append(hook)
        self.post_accumulate_grad_hooks = hooks
        return lambda: hooks.remove(hook) if hook in hooks else None

    def retain_grad(self) -> None:
        """Keep ``.grad`` on a non-leaf after backward (leaves always keep it)."""
        if not self._rg:
            raise AutogradError("retain_grad: the tensor does not require grad")
        if self.grad_fn is None or self._retains_grad:
            return
        self._retains_grad = True
        self.grad_fn.retain_output_grad(self.output_nr, self)

    @property
    def retains_grad(self) -> _bool:
        return self._retains_grad

    # -- operators (bodies in blutrain.tensor.ops) ---------------------------------------------
    def __add__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("add", self, other)

    def __radd__(self, other: Scalar) -> Tensor:
        return _ew.binary("add", other, self)

    def __sub__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("sub", self, other)

    def __rsub__(self, other: Scalar) -> Tensor:
        return _ew.binary("sub", other, self)

    def __mul__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("mul", self, other)

    def __rmul__(self, other: Scalar) -> Tensor:
        return _ew.binary("mul", other, self)

    def __truediv__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("div", self, other)

    def __rtruediv__(self, other: Scalar) -> Tensor:
        return _ew.binary("div", other, self)

    def __floordiv__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("floor_divide", self, other)

    def __rfloordiv__(self, other: Scalar) -> Tensor:
        return _ew.binary("floor_divide", other, self)

    def __mod__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("remainder", self, other)

    def __rmod__(self, other: Scalar) -> Tensor:
        return _ew.binary("remainder", other, self)

    def __pow__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("pow", self, other)

    def __rpow__(self, other: Scalar) -> Tensor:
        return _ew.binary("pow", other, self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return _la.matmul(self, other)

    def __rmatmul__(self, other: Tensor) -> Tensor:
        return _la.matmul(other, self)

    def __neg__(self) -> Tensor:
        return _ew.unary("neg", self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return _ew.unary("abs", self)

    def __invert__(self) -> Tensor:
        return _ew.unary("logical_not" if self.dtype.name == "bool" else "bitwise_not", self)

    def __and__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.bitwise("and", self, other)

    def __rand__(self, other: Scalar) -> Tensor:
        return _ew.bitwise("and", other, self)

    def __or__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.bitwise("or", self, other)

    def __ror__(self, other: Scalar) -> Tensor:
        return _ew.bitwise("or", other, self)

    def __xor__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.bitwise("xor", self, other)

    def __rxor__(self, other: Scalar) -> Tensor:
        return _ew.bitwise("xor", other, self)

    def __eq__(self, other: object) -> Tensor:  # type: ignore[override]
        if not isinstance(other, (Tensor, builtins.bool, builtins.int, builtins.float)):
            return NotImplemented  # ``t == None`` is False, as in PyTorch
        return _ew.binary("eq", self, other)

    def __ne__(self, other: object) -> Tensor:  # type: ignore[override]
        if not isinstance(other, (Tensor, builtins.bool, builtins.int, builtins.float)):
            return NotImplemented
        return _ew.binary("ne", self, other)

    def __lt__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("lt", self, other)

    def __le__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("le", self, other)

    def __gt__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("gt", self, other)

    def __ge__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("ge", self, other)

    # in-place arithmetic (bumps the version counter)
    def __iadd__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("add", self, other)

    def __isub__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("sub", self, other)

    def __imul__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("mul", self, other)

    def __itruediv__(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("div", self, other)

    def add_(self, other: Tensor | Scalar, alpha: Scalar = 1) -> Tensor:
        return _ew.inplace("add", self, other if alpha == 1 else other * alpha)

    def sub_(self, other: Tensor | Scalar, alpha: Scalar = 1) -> Tensor:
        return _ew.inplace("sub", self, other if alpha == 1 else other * alpha)

    def mul_(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("mul", self, other)

    def div_(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("div", self, other)

    def pow_(self, other: Tensor | Scalar) -> Tensor:
        return _ew.inplace("pow", self, other)

    def clamp_(self, min: Scalar | None = None, max: Scalar | None = None) -> Tensor:
        return _ew.assign(self, _ew.clamp(self.detach(), min, max), "clamp_")

    def zero_(self) -> Tensor:
        return _ew.fill_(self, 0, "zero_")

    def fill_(self, value: Scalar | Tensor) -> Tensor:
        return _ew.fill_(self, value)

    def copy_(self, src: Tensor) -> Tensor:
        return _ew.assign(self, src)

    def uniform_(self, a: _float = 0.0, b: _float = 1.0) -> Tensor:
        return _ew.uniform_(self, a, b)

    def normal_(self, mean: _float = 0.0, std: _float = 1.0) -> Tensor:
        return _ew.normal_(self, mean, std)

    def masked_fill_(self, mask: Tensor, value: Scalar) -> Tensor:
        return _ew.assign(self, _ew.masked_fill(self.detach(), mask, value), "masked_fill_")

    # methods mirroring the functional API
    def add(self, other: Tensor | Scalar, alpha: Scalar = 1) -> Tensor:
        return _ew.binary("add", self, other if alpha == 1 else other * alpha)

    def sub(self, other: Tensor | Scalar, alpha: Scalar = 1) -> Tensor:
        return _ew.binary("sub", self, other if alpha == 1 else other * alpha)

    def mul(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("mul", self, other)

    def div(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("div", self, other)

    def pow(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("pow", self, other)

    def maximum(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("maximum", self, other)

    def minimum(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("minimum", self, other)

    def eq(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("eq", self, other)

    def ne(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("ne", self, other)

    def lt(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("lt", self, other)

    def le(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("le", self, other)

    def gt(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("gt", self, other)

    def ge(self, other: Tensor | Scalar) -> Tensor:
        return _ew.binary("ge", self, other)

    def neg(self) -> Tensor:
        return _ew.unary("neg", self)

    def exp(self) -> Tensor:
        return _ew.unary("exp", self)

    def log(self) -> Tensor:
        return _ew.unary("log", self)

    def sqrt(self) -> Tensor:
        return _ew.unary("sqrt", self)

    def rsqrt(self) -> Tensor:
        return _ew.unary("rsqrt", self)

    def tanh(self) -> Tensor:
        return _ew.unary("tanh", self)

    def sigmoid(self) -> Tensor:
        return _ew.unary("sigmoid", self)

    def abs(self) -> Tensor:
        return _ew.unary("abs", self)

    def sin(self) -> Tensor:
        return _ew.unary("sin", self)

    def cos(self) -> Tensor:
        return _ew.unary("cos", self)

    def relu(self) -> Tensor:
        return _ew.unary("relu", self)

    def square(self) -> Tensor:
        return _ew.binary("mul", self, self)

    def reciprocal(self) -> Tensor:
        return _ew.binary("div", 1.0, self)

    clamp = _ew.clamp
    clip = clamp

    masked_fill = _ew.masked_fill

    def sum(self, dim: _int | Sequence[_int] | None = None, keepdim: _bool = False,
            dtype: DType | str | None = None) -> Tensor:
        return _rd.sum(self, dim, keepdim, dtype=dtype)

    mean = _rd.mean
    max = _rd.max
    min = _rd.min
    amax = _rd.amax
    amin = _rd.amin
    argmax = _rd.argmax
    argmin = _rd.argmin

    def var(self, dim: _int | Sequence[_int] | None = None, correction: _int = 1, keepdim: _bool = False,
            unbiased: _bool | None = None) -> Tensor:
        return _rd.var(self, dim, correction=correction, keepdim=keepdim, unbiased=unbiased)

    def std(self, dim: _int | Sequence[_int] | None = None, correction: _int = 1, keepdim: _bool = False,
            unbiased: _bool | None = None) -> Tensor:
        return _rd.std(self, dim, correction=correction, keepdim=keepdim, unbiased=unbiased)

    norm = _rd.norm
    logsumexp = _rd.logsumexp

    def softmax(self, dim: _int) -> Tensor:
        return _rd.softmax(self, dim)

    def log_softmax(self, dim: _int) -> Tensor:
        return _rd.log_softmax(self, dim)

    all = _rd.all
    any = _rd.any

    def matmul(self, other: Tensor) -> Tensor:
        return _la.matmul(self, other)

    def bmm(self, other: Tensor) -> Tensor:
        return _la.bmm(self, other)

    index_select = _ix.index_select
    gather = _ix.gather
    scatter_add = _ix.scatter_add

    def index_add(self, dim: _int, index: Tensor, source: Tensor, alpha: Scalar = 1) -> Tensor:
        return _ix.index_add(self, dim, index, source, alpha=alpha)

    tril = _ix.tril
    triu = _ix.triu

    def repeat(self, *sizes: Any) -> Tensor:
        return _sh.repeat(self, _shape_arg(sizes, "sizes"))




_autograd_module: Any = None


def _ensure_autograd() -> Any:
    """Autograd is a separate distribution; it is imported the first time a tensor needs it."""
    global _autograd_module
    if _autograd_module is None:
        import importlib

        try:
            _autograd_module = importlib.import_module("blutrain.autograd")
        except ImportError as exc:
            raise AutogradError("gradients need the blutrain-autograd package: pip install blutrain-autograd") from exc
    return _autograd_module


def as_tensor_data(data: Any, *, dtype: DType | str | None = None, device: str | Device | None = None) -> Tensor:
    """Build a new Tensor (copying) from nested lists, scalars, NumPy arrays or another Tensor."""
    dev = globals()["device"](device) if device is not None else None
    dt = as_dtype(dtype) if dtype is not None else None
    if isinstance(data, Tensor):
        out = data.detach().to(device=dev, dtype=dt)
        return out.clone() if out.storage is data.storage else out
    from blutrain.tensor.dtype import get_default_dtype

    if isinstance(data, np.ndarray):
        host = data
    else:
        try:
            host = np.asarray(data)
        except ValueError as exc:  # ragged nested lists
            raise TensorValueError(f"tensor: {type(data).__name__} data must be rectangular: {exc}") from None
        if host.dtype == object:
            raise TensorTypeError(f"tensor: cannot build a tensor from {type(data).__name__} {data!r}")
        if dt is None and host.dtype.kind == "f":
            host = host.astype(get_default_dtype().np)
        if dt is None and host.dtype.kind in "iu":
            host = host.astype(np.int64)
    if dt is None:
        dt = from_numpy_dtype(host.dtype)
    # always a fresh C-ordered copy; np.array, since np.ascontiguousarray turns 0-d into shape (1,)
    host = np.array(host, dtype=dt.np, order="C", copy=True)
    dev = dev if dev is not None else globals()["device"]("cpu")
    arr = dev.backend.from_host(host, dev.index) if dev.type != "cpu" else host
    return Tensor._make(arr, dt, dev)


def from_numpy(array: np.ndarray[Any, Any]) -> Tensor:
    """A CPU tensor sharing memory with ``array`` (as ``torch.from_numpy``)."""
    if not isinstance(array, np.ndarray):
        raise TensorTypeError(f"from_numpy: expected a numpy.ndarray, got {type(array).__name__}")
    if any(s < 0 for s in array.strides):
        raise TensorValueError("from_numpy: arrays with negative strides are not supported; copy the array first")
    return Tensor._make(array, from_numpy_dtype(array.dtype), device("cpu"))


def from_dlpack(obj: Any) -> Tensor:
    """Zero-copy import of any object with ``__dlpack__`` (NumPy, CuPy, PyTorch, JAX...)."""
    from blutrain.tensor.backend import backends

    if not hasattr(obj, "__dlpack_device__"):
        raise TensorTypeError(f"from_dlpack: {type(obj).__name__} does not implement __dlpack_device__")
    dev_type, dev_index = obj.__dlpack_device__()
    for name, backend in backends().items():
        if backend.dlpack_device_type == dev_type:
            arr = backend.xp.from_dlpack(obj)
            dev = device(name, builtins.int(dev_index) if name != "cpu" else 0)
            return Tensor._make(arr, from_numpy_dtype(arr.dtype), dev)
    raise TensorValueError(f"from_dlpack: no installed backend handles DLPack device type {dev_type}")

