"""Where a run's model comes from: a preset, or a Hugging Face GPT-2 directory (``--init-from``).

With ``init_from`` the architecture is the directory's ``config.json`` and the initial weights its
``model.safetensors`` (the layout :meth:`GPT2.from_pretrained` reads and ``blutrain export --format hf``
writes); a ``preset`` given as well must name the same architecture (layers, heads, width), so that a
typo in either is not trained for hours. Without it the preset (``tiny`` by default) is drawn at random,
``tiny``'s vocabulary sized to the data's.
"""

from __future__ import annotations

from pathlib import Path

from blutrain.models import ModelError
from blutrain.models.gpt2 import GPT2, PRESETS, GPT2Config, load_pretrained_state
from blutrain.nn import StateDictError
from blutrain.train.config import ConfigError, TrainConfig

_ARCHITECTURE = ("n_layer", "n_head", "n_embd")  # what a preset names (GPT-2's vocabulary is padded in presets)
_SHAPES = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")  # what pretrained weights fix


def _describe(values: dict[str, object]) -> str:
    return f"{values['n_layer']} layers × width {values['n_embd']}, {values['n_head']} heads"


def _pretrained_directory(cfg: TrainConfig) -> Path:
    root = Path(cfg.init_from or "")
    if root.is_file():
        raise ConfigError(f"init_from {root}: is a file; expected a Hugging Face GPT-2 directory holding config.json "
                          "and model.safetensors. To continue a BluTrain checkpoint give --resume; to start from its "
                          "weights, write that layout first: blutrain export CKPT --format hf --out DIR")
    if not root.is_dir():
        raise ConfigError(f"init_from {root}: no such directory; expected a Hugging Face GPT-2 directory holding "
                          "config.json and model.safetensors (blutrain export --format hf writes one)")
    return root


def model_config(cfg: TrainConfig, data_vocab_size: int) -> GPT2Config:
    """The architecture ``cfg`` trains (with ``model_overrides`` applied); raises :class:`ConfigError` when
    ``init_from``'s config.json and ``preset`` disagree or either cannot be read."""
    overrides = dict(cfg.model_overrides)
    if cfg.init_from is None:
        preset = cfg.preset or "tiny"
        if preset == "tiny":
            overrides.setdefault("vocab_size", data_vocab_size)
        return GPT2Config.preset(preset, **overrides)
    root = _pretrained_directory(cfg)
    try:
        config = GPT2Config.from_pretrained(root, **overrides)
        stored = GPT2Config.from_pretrained(root)
    except ModelError as exc:
        raise ConfigError(f"init_from {root}: {exc}") from None
    reshaped = [f"{k}={overrides[k]!r} (config.json: {getattr(stored, k)!r})" for k in _SHAPES
                if k in overrides and overrides[k] != getattr(stored, k)]
    if reshaped:
        raise ConfigError(f"model_overrides {', '.join(reshaped)} would change the shapes of {root}'s weights; with "
                          "init_from the architecture comes from config.json: leave those overrides out")
    if cfg.preset is not None:
        if cfg.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, got {cfg.preset!r}")
        wanted = {k: PRESETS[cfg.preset][k] for k in _ARCHITECTURE}
        found = {k: getattr(config, k) for k in _ARCHITECTURE}
        if wanted != found:
            raise ConfigError(f"preset {cfg.preset!r} ({_describe(wanted)}) disagrees with {root / 'config.json'} "
                              f"({_describe(found)}); leave --preset out (with --init-from the architecture comes "
                              "from config.json) or give the preset of that size")
    return config


def load_initial_weights(net: GPT2, cfg: TrainConfig) -> None:
    """Copy ``init_from``'s weights into ``net`` (built from :func:`model_config`); nothing changes on
    an error, which names the directory and the mismatched tensors."""
    root = _pretrained_directory(cfg)
    try:
        net.load_state_dict(load_pretrained_state(root))  # copies in place, onto the model's device
    except (ModelError, StateDictError) as exc:
        raise ConfigError(f"init_from {root}: {exc}") from None


__all__ = ["load_initial_weights", "model_config"]
