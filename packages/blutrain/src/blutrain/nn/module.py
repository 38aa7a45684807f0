"""Module: the container of parameters, buffers and submodules that models are built from.

Assigning a :class:`Parameter`, a :class:`Module` or (through :meth:`Module.register_buffer`) a
buffer to an attribute registers it by name; the value also stays a plain instance attribute, so
reading ``self.weight`` in ``forward`` is an ordinary attribute lookup with no ``__getattr__`` in
the per-step path. Names joined by dots (``transformer.h.0.attn.c_attn.weight``) address state
in :meth:`state_dict`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Self, TypeGuard, TypeVar

from blutrain.autograd import no_grad
from blutrain.nn.errors import ModuleError, StateDictError
from blutrain.nn.parameter import Parameter
from blutrain.tensor import DType, Tensor, as_dtype
from blutrain.tensor.device import Device
from blutrain.tensor.errors import TensorTypeError

ForwardPreHook = Callable[["Module", tuple[Any, ...]], Any]
ForwardHook = Callable[["Module", tuple[Any, ...], Any], Any]

_hook_ids = itertools.count()


class RemovableHandle:
    """Returned by the ``register_*_hook`` methods; ``remove()`` unregisters the hook."""

    __slots__ = ("_hooks", "id")

    def __init__(self, hooks: dict[int, Any]) -> None:
        self._hooks = hooks
        self.id = next(_hook_ids)

    def remove(self) -> None:
        self._hooks.pop(self.id, None)


class LoadResult(NamedTuple):
    """What :meth:`Module.load_state_dict` did not match (empty lists under ``strict=True``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise ModuleError(f"{kind} name must be a non-empty str without '.', got {name!r}")
    return name


def _forward_unimplemented(self: Module, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{type(self).__name__} does not define forward()")


def _named_tensors(groups: Iterable[tuple[str, Iterable[tuple[str, Tensor | None]]]],
                   remove_duplicate: bool) -> Iterator[tuple[str, Tensor]]:
    """(dotted name, tensor) for each (module prefix, that module's named tensors) of ``groups``, in order, passing
    over None entries; with ``remove_duplicate`` a tensor met before (a tied weight) is passed over, so it comes
    once, under the first name."""
    seen: set[int] = set()
    for prefix, entries in groups:
        for name, t in entries:
            if t is None:
                continue
            if remove_duplicate:
                if id(t) in seen:
                    continue
                seen.add(id(t))
            yield (f"{prefix}.{name}" if prefix else name), t

class Module:
    """Base class of every layer and model; subclasses set attributes in ``__init__`` and define
    ``forward``. Calling the module runs its forward pre-hooks, ``forward`` and forward hooks."""

    training: bool
    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Tensor | None]
    _non_persistent: set[str]
    _modules: dict[str, Module | None]
    _forward_pre_hooks: dict[int, ForwardPreHook]
    _forward_hooks: dict[int, ForwardHook]

    # A class attribute, not a method, so that subclasses may give forward any signature
    # (PyTorch does the same for the same reason: mypy's override check).
    forward: Callable[..., Any] = _forward_unimplemented

    def __init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "training", True)
        set_(self, "_parameters", {})
        set_(self, "_buffers", {})
        set_(self, "_non_persistent", set())
        set_(self, "_modules", {})
        set_(self, "_forward_pre_hooks", {})
        set_(self, "_forward_hooks", {})

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._forward_pre_hooks and not self._forward_hooks:
            return self.forward(*args, **kwargs)
        for hook in list(self._forward_pre_hooks.values()):
            new = hook(self, args)
            if new is not None:
                args = new if isinstance(new, tuple) else (new,)
        out = self.forward(*args, **kwargs)
        for post in list(self._forward_hooks.values()):
            res = post(self, args, out)
            if res is not None:
                out = res
        return out

    def register_forward_pre_hook(self, hook: ForwardPreHook) -> RemovableHandle:
        """``hook(module, args)`` runs before ``forward``; returning a value replaces the positional args."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle.id] = hook
        return handle

    def register_forward_hook(self, hook: ForwardHook) -> RemovableHandle:
        """``hook(module, args, output)`` runs after ``forward``; returning a value replaces the output."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle.id] = hook
        return handle

    # -- registration ----------------------------------------------------------------------
    def _registries(self, name: str, value: object) -> tuple[dict[str, Any], ...]:
        d = self.__dict__
        registries = (d.get("_parameters"), d.get("_buffers"), d.get("_modules"))
        if registries[0] is None:
            raise ModuleError(f"{type(self).__name__}: cannot assign {type(value).__name__} to '{name}' "
                              "before Module.__init__() ran; call super().__init__() first in __init__")
        return registries  # type: ignore[return-value]

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            params, buffers, modules = self._registries(name, value)
            buffers.pop(name, None)
            modules.pop(name, None)
            self._non_persistent.discard(name)
            params[name] = value
        elif isinstance(value, Module):
            params, buffers, modules = self._registries(name, value)
            params.pop(name, None)
            buffers.pop(name, None)
            self._non_persistent.discard(name)
            modules[name] = value
        else:
            d = self.__dict__
            if name in d.get("_parameters", ()):
                if value is not None:
                    raise ModuleError(
                        f"{type(self).__name__}.{name} is a parameter: assign a Parameter or None, got "
                        f"{type(value).__name__}; to change its values use .copy_() under no_grad()")
                self._parameters[name] = None
            elif name in d.get("_buffers", ()):
                if value is not None and not isinstance(value, Tensor):
                    raise ModuleError(f"{type(self).__name__}.{name} is a buffer: assign a Tensor or None, "
                                      f"got {type(value).__name__}")
                self._buffers[name] = value
            elif name in d.get("_modules", ()):
                if value is not None:
                    raise ModuleError(f"{type(self).__name__}.{name} is a submodule: assign a Module or "
                                      f"None, got {type(value).__name__}")
                self._modules[name] = None
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for reg in (self._parameters, self._buffers, self._modules):
            reg.pop(name, None)
        self._non_persistent.discard(name)
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        _check_name("parameter", name)
        if param is not None and not isinstance(param, Parameter):
            raise ModuleError(f"register_parameter: '{name}' must be a Parameter or None, got "
                              f"{type(param).__name__}")
        if param is None:
            self._registries(name, param)
            self._buffers.pop(name, None)
            self._modules.pop(name, None)
            self._parameters[name] = None
        setattr(self, name, param)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """A tensor that is state but not trained (moved by ``to()``; saved unless ``persistent=False``)."""
        _check_name("buffer", name)
        if tensor is not None and (not isinstance(tensor, Tensor) or isinstance(tensor, Parameter)):
            raise ModuleError(f"register_buffer: '{name}' must be a Tensor (not a Parameter) or None, got "
                              f"{type(tensor).__name__}")
        params, buffers, modules = self._registries(name, tensor)
        if name in params or name in modules:
            raise ModuleError(f"register_buffer: '{name}' is already a parameter or submodule of "
                              f"{type(self).__name__}")
        buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)
        object.__setattr__(self, name, tensor)

    def add_module(self, name: str, module: Module | None) -> None:
        _check_name("module", name)
        if module is not None and not isinstance(module, Module):
            raise ModuleError(f"add_module: '{name}' must be a Module or None, got {type(module).__name__}")
        if module is None:
            self._registries(name, module)
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
            self._modules[name] = None
        setattr(self, name, module)

    # -- traversal -------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen: set[int] = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "", remove_duplicate: bool = True,
                      _memo: set[int] | None = None) -> Iterator[tuple[str, Module]]:
        """This module and every descendant, depth first, each once unless ``remove_duplicate=False``."""
        memo = set() if _memo is None else _memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(f"{prefix}.{name}" if prefix else name, remove_duplicate, memo)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def _named_members(self, kind: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Tensor]]:
        mods = self.named_modules(prefix, remove_duplicate) if recurse else iter([(prefix, self)])
        return _named_tensors(((mod_prefix, (mod._parameters if kind == "parameters" else mod._buffers).items())
                               for mod_prefix, mod in mods), remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) pairs; a parameter shared by two modules (tied weights) comes once,
        under the first name met."""
        yield from self._named_members("parameters", prefix, recurse, remove_duplicate)  # type: ignore[misc]

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        yield from self._named_members("buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn: Callable[[Module], None]) -> Self:
        """Call ``fn`` on every submodule, children first, then on this module."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # -- state -----------------------------------------------------------------------------
    def _state_entries(self, remove_duplicate: bool) -> Iterator[tuple[str, Tensor]]:
        """Parameters and persistent buffers, in module order."""
        return _named_tensors(((mod_prefix, itertools.chain(
            mod._parameters.items(), ((n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent)))
            for mod_prefix, mod in self.named_modules(remove_duplicate=remove_duplicate)), remove_duplicate)

    def state_dict(self, keep_vars: bool = False) -> dict[str, Tensor]:
        """Dotted name → tensor for every parameter and persistent buffer, sharing storage with the
        module (detached unless ``keep_vars``). Tied weights appear once, under their first name;
        :meth:`load_state_dict` also accepts the other names."""
        return {name: (t if keep_vars else t.detach()) for name, t in self._state_entries(True)}

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> LoadResult:
        """Copy ``state_dict`` into this module's tensors in place (casting dtype, moving device).

        Every key is checked before anything is copied. A shape mismatch is always an error; missing
        and unexpected keys are errors under ``strict`` and are returned otherwise.
        """
        if not isinstance(state_dict, dict):
            raise StateDictError(f"load_state_dict: state_dict must be a dict of str → Tensor, got "
                                 f"{type(state_dict).__name__}")
        targets = dict(self._state_entries(remove_duplicate=False))
        canonical = [name for name, _ in self._state_entries(remove_duplicate=True)]
        provided_ids = set()
        unexpected: list[str] = []
        mismatched: list[str] = []
        not_tensor: list[str] = []
        for key, value in state_dict.items():
            target = targets.get(key)
            if target is None:
                unexpected.append(key)
            elif not isinstance(value, Tensor):
                not_tensor.append(f"'{key}' ({type(value).__name__})")
            elif value.shape != target.shape:
                mismatched.append(f"'{key}': expected shape {list(target.shape)}, got {list(value.shape)}")
            else:
                provided_ids.add(id(target))
        missing = [name for name in canonical if id(targets[name]) not in provided_ids]
        problems = []
        if not_tensor:
            problems.append("values that are not Tensors: " + ", ".join(not_tensor))
        if mismatched:
            problems.append("shape mismatch for " + "; ".join(mismatched))
        if strict and missing:
            problems.append("missing keys: " + ", ".join(missing))
        if strict and unexpected:
            problems.append("unexpected keys: " + ", ".join(unexpected))
        if problems:
            raise StateDictError(f"load_state_dict into {type(self).__name__}: " + "; ".join(problems))
        with no_grad():
            for key, value in state_dict.items():
                target = targets.get(key)
                if target is not None:
                    target.copy_(value)
        return LoadResult(missing, unexpected)

    # -- modes and placement ---------------------------------------------------------------
    def train(self, mode: bool = True) -> Self:
        """Training mode (dropout active) for this module and every descendant."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> Self:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def to(self, *args: Any, device: str | Device | None = None, dtype: DType | str | None = None) -> Self:
        """``to(device)``, ``to(dtype)``, ``to(device, dtype)``: moves and casts parameters *in place*
        (same Parameter objects, so an optimizer built earlier stays valid) and their grads; floating
        buffers are cast, integer buffers keep their dtype."""
        for a in args:
            if isinstance(a, DType):
                dtype = a
            elif isinstance(a, Device):
                device = a
            elif isinstance(a, str):
                try:
                    dtype = as_dtype(a)
                except TensorTypeError:
                    device = a
            else:
                raise ModuleError(f"to: expected a device or a dtype, got {a!r}")
        dt = as_dtype(dtype) if dtype is not None else None

        def convert(t: Tensor) -> Tensor:
            cast = dt if (dt is not None and t.dtype.is_floating) else None
            return t.detach().to(device=device, dtype=cast)

        with no_grad():
            for p in self.parameters():
                new = convert(p)
                if new.storage is not p.storage:
                    p.data = new  # keeps the parameter's identity, requires_grad and hooks
                if p.grad is not None:
                    p.grad = convert(p.grad)
            for m in self.modules():
                for name, b in list(m._buffers.items()):
                    if b is not None:
                        new_b = convert(b)
                        if new_b.storage is not b.storage:
                            setattr(m, name, new_b)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's ``.grad`` (or zero it in place with ``set_to_none=False``)."""
        for p in self.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                with no_grad():
                    p.grad.detach().zero_()

    # -- printing --------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = []
        for name, m in self._modules.items():
            body = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        head = f"{type(self).__name__}({extra}" if extra else f"{type(self).__name__}("
        return head + "\n" + "\n".join(lines) + "\n)"


_M = TypeVar("_M", bound=Module)


def is_plain(module: Module, cls: type[_M]) -> TypeGuard[_M]:
    """Whether ``module`` is exactly a ``cls`` (not a subclass, not a plugin's replacement) with no forward
    hooks: its call computes ``cls.forward`` and nothing else, so a caller may compute the same another
    way (a fused op of several such modules)."""
    return type(module) is cls and not module._forward_pre_hooks and not module._forward_hooks


__all__ = ["ForwardHook", "ForwardPreHook", "LoadResult", "Module", "RemovableHandle", "is_plain"]
