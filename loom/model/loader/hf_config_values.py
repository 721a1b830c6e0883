"""A checkpoint's Hugging Face config as plain values, so ranks never import transformers.

``resolve_against_checkpoint`` (loom/checkpoint_defaults.py) reads the checkpoint's config
once, with ``transformers`` (in the API process, or the offline ``LLM``'s), and keeps it
in ``ModelConfig.hf_config`` as plain values (msgpack- and pickle-able: the engine core
gets its config as msgpack, a rank as a pickled ``WorkerSpec``). The engine core and each
worker read it back through :class:`HFConfigView`, attribute for attribute what the config
object answered, so starting a rank costs no ``import transformers`` (seconds of CPU per
process, more than ``import torch``; docs/architecture.md, "Worker life cycle").

What is kept: every public attribute the config answers (instance fields, class-level
defaults such as ``model_type``, properties, ``attribute_map`` aliases such as
``num_local_experts``), ``torch.dtype`` values as their names (``"bfloat16"``, as
``to_dict`` writes them), sub-configs as nested views. Methods, and values that are not
plain data (``sub_configs``' classes), are not: the model code reads attributes only.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import Any

_SUB_CONFIG = "__hf_config__"  # marks a nested config among the values
_PRIVATE_KEPT = ("_name_or_path",)
_NOT_PLAIN = object()


def hf_config_values(config: Any) -> dict[str, Any]:
    """``config`` (a ``transformers`` config, or an :class:`HFConfigView`) as plain values."""
    if isinstance(config, HFConfigView):
        return _view_values(config)
    names = {name for name in dir(config)
             if not name.startswith("_") or name in _PRIVATE_KEPT}
    names.update(getattr(type(config), "attribute_map", None) or {})
    values: dict[str, Any] = {}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # deprecated properties (torch_dtype) would warn
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in sorted(names):
                try:
                    value = getattr(config, name)
                except Exception:  # a property that does not apply to this config
                    continue
                if callable(value) and not _is_config(value):
                    continue
                plain = _plain(value)
                if plain is not _NOT_PLAIN:
                    values[name] = plain
    finally:
        quiet.setLevel(level)
    return values


class HFConfigView(types.SimpleNamespace):
    """Attribute access over :func:`hf_config_values`; an attribute the config did not
    have raises AttributeError, so ``getattr(view, name, default)`` reads as it did."""

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> HFConfigView:
        return cls(**{name: _view(value) for name, value in values.items()})


def _view_values(view: HFConfigView) -> dict[str, Any]:
    return {name: _plain(value) for name, value in vars(view).items()}


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(type(value), "model_type") and \
        not isinstance(value, type)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, HFConfigView):
        return {_SUB_CONFIG: _view_values(value)}
    if _is_config(value):
        return {_SUB_CONFIG: hf_config_values(value)}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    if isinstance(value, dict):
        items = {key: _plain(item) for key, item in value.items()}
        if any(item is _NOT_PLAIN for item in items.values()) or \
                not all(isinstance(key, (str, int)) for key in items):
            return _NOT_PLAIN
        return items
    return _NOT_PLAIN


def _view(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_SUB_CONFIG}:
        return HFConfigView.from_values(value[_SUB_CONFIG])
    return value
