"""What a model family declares: :class:`ModelSpec`, and the :class:`Model` protocol its module meets.

A family is a module class built from a config, named presets of that config, the Hugging Face
architecture it reads and writes, and its parallel plan. The trainer, ``blutrain generate``, the
benchmarks and the parallelism modes reach a model only through these declarations (as torchtitan's
trainer reaches a model through its ``ModelSpec``), so a new family is a plugin and touches no core file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from blutrain.models.errors import ModelError
from blutrain.models.parallel_plan import ModelParallelPlan
from blutrain.tensor import Tensor
from blutrain.tensor.errors import ShapeError, TensorTypeError


class ModelConfig(Protocol):
    """The architecture of one model: what the trainer reads of it, and its fields as a plain dict
    (``ModelSpec.config_from_dict`` rebuilds it, e.g. from a checkpoint's metadata)."""

    block_size: int
    vocab_size: int

    def to_dict(self) -> dict[str, Any]: ...


class Model(Protocol):
    """A decoder language model as the trainer, ``generate`` and the parallel modes use it; it is also a
    :class:`blutrain.nn.Module` (parameters, state dicts, ``to``, ``train``/``eval``).

    ``model(idx, targets=None, return_logits=True)`` returns ``(logits, loss)``: logits (B, T, vocab) and
    the mean cross-entropy against ``targets`` (B, T; -1 ignored); ``return_logits=False`` with targets
    may compute the loss without the logits and returns ``(None, loss)``.
    ``hidden_states(idx, positions)`` is the trunk alone: the final-normalised hidden states (B, T, C) of
    tokens ``idx`` at sequence ``positions`` (int64, (T,); default ``0 .. T-1``), what a parallel mode
    feeds its own head and loss (context parallelism gives each rank's chunks their global positions).
    ``generate(..., use_cache)``: a family with a KV cache decodes incrementally where ``use_cache``; one without
    recomputes the context for every token either way (the same tokens). ``parallel_plan`` (a class attribute)
    says what tensor and context parallelism cut; None: neither applies. ``flops_per_token(seq_len)`` is what
    the trainer's MFU counts.
    """

    config: Any

    @property
    def parallel_plan(self) -> ModelParallelPlan | None: ...

    def __call__(self, idx: Tensor, targets: Tensor | None = None, *,
                 return_logits: bool = True) -> tuple[Tensor | None, Tensor | None]: ...

    def check_ids(self, idx: Tensor, argument: str = "idx", check_length: bool = True) -> None: ...

    def hidden_states(self, idx: Tensor, positions: Tensor | None = None) -> Tensor: ...

    def num_parameters(self) -> int: ...

    def flops_per_token(self, seq_len: int) -> int:
        """FLOPs of one training step per token at sequence length ``seq_len``: 3 × the forward's (backward
        costs twice the forward), GEMMs and attention's two T-long products counted, as PaLM's MFU does."""
        ...

    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, use_cache: bool = True) -> Tensor: ...

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None: ...


class ModelClass(Protocol):
    """The module class of a family: built from its config, or from a Hugging Face directory; its
    ``parallel_plan`` is the models'."""

    @property
    def parallel_plan(self) -> ModelParallelPlan | None: ...

    def __call__(self, config: Any) -> Model: ...

    def from_pretrained(self, directory: str | os.PathLike[str], **overrides: Any) -> Model: ...


# The config class of a family: built from its fields as keyword arguments (a ``ModelError`` on bad values).
ConfigClass = Callable[..., ModelConfig]


@dataclass(frozen=True)
class HFMapping:
    """The Hugging Face architecture a family reads and writes (``config.json``'s ``model_type`` and
    ``architectures``); the family's ``from_pretrained`` / ``save_pretrained`` translate config keys,
    tensor names and layouts."""

    model_type: str
    architecture: str


@dataclass(frozen=True)
class ModelSpec:
    """One model family, as a plugin registers it (``registry.register(spec.name, spec)``)."""

    name: str
    model_class: ModelClass
    config_class: ConfigClass
    presets: Mapping[str, Mapping[str, Any]]
    hf: HFMapping | None = None
    description: str = ""
    # the preset a run uses when it names none; every family should have a small CPU one named "tiny"
    default_preset: str = "tiny"

    def __post_init__(self) -> None:
        if self.default_preset not in self.presets:
            raise ModelError(f"ModelSpec {self.name!r}: default_preset {self.default_preset!r} is not one of its "
                             f"presets ({', '.join(self.presets)})")

    def config(self, preset: str | None = None, **overrides: Any) -> ModelConfig:
        """The named preset's config with ``overrides`` applied; an unknown preset or field is a
        ``ModelError`` listing the family's presets or fields."""
        name = self.default_preset if preset is None else preset
        if name not in self.presets:
            raise ModelError(f"model {self.name!r}: unknown preset {name!r}; expected one of "
                             f"{', '.join(self.presets)}")
        return self.config_from_dict({**self.presets[name], **overrides})

    def config_from_dict(self, values: Mapping[str, Any]) -> ModelConfig:
        """The config of these field values (a checkpoint's ``config["model"]``)."""
        try:
            return self.config_class(**values)
        except TypeError as exc:  # an unknown field name
            known = ([f.name for f in dataclasses.fields(self.config_class)]
                     if dataclasses.is_dataclass(self.config_class) else list(next(iter(self.presets.values()))))
            raise ModelError(f"model {self.name!r}: {exc}; its config fields are {', '.join(sorted(known))}") from None

    @property
    def parallel_plan(self) -> ModelParallelPlan | None:
        """What tensor and context parallelism cut in this family's models (declared by its module class)."""
        return self.model_class.parallel_plan

    def build(self, config: ModelConfig) -> Model:
        """A freshly initialised model of ``config`` (weights from the default generator)."""
        return self.model_class(config)

    def from_pretrained(self, directory: str | os.PathLike[str], **overrides: Any) -> Model:
        """The model of a Hugging Face directory of this family's architecture."""
        if self.hf is None:
            raise ModelError(f"model {self.name!r} declares no Hugging Face mapping; it cannot load {directory}")
        return self.model_class.from_pretrained(directory, **overrides)


def check_token_ids(owner: str, idx: Tensor, block_size: int, argument: str = "idx", check_length: bool = True) -> None:
    """What a family's ``check_ids`` refuses: anything but (batch, time) integer token ids, and (with
    ``check_length``) more than ``block_size`` of them; ``owner`` (the model class's name) starts the message."""
    if not isinstance(idx, Tensor) or idx.dtype.is_floating or idx.dtype.name == "bool":
        got = idx.dtype.name if isinstance(idx, Tensor) else type(idx).__name__
        raise TensorTypeError(f"{owner}: {argument} must be an integer Tensor of token ids, got {got}")
    if idx.ndim != 2:
        raise ShapeError(f"{owner}: {argument} must be (batch, time), got shape {list(idx.shape)}")
    if check_length and idx.shape[1] > block_size:
        raise ShapeError(f"{owner}: sequence length {idx.shape[1]} exceeds block_size {block_size}")


__all__ = ["ConfigClass", "HFMapping", "Model", "ModelClass", "ModelConfig", "ModelSpec", "check_token_ids"]
