"""ModelConfig.hf_config: the checkpoint's HF config as plain values drives the model as
the transformers config does (loom/model/loader/hf_config_values.py)."""

from __future__ import annotations

import dataclasses
import pickle

import msgspec
import pytest
import torch

from loom.config import EngineConfig
from loom.engine_args import make_engine_config
from loom.model.loader import load_hf_config, load_model, model_hf_config
from loom.model.loader.hf_config_values import HFConfigView, hf_config_values

from .checkpoints import FAMILIES, make_tiny_checkpoint
from .paged import PagedDriver


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_config_values")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


def shipped(values: dict) -> HFConfigView:
    """As a rank gets them: msgpack to the engine core, then pickled to a worker."""
    values = msgspec.msgpack.decode(msgspec.msgpack.encode(values))
    return pickle.loads(pickle.dumps(HFConfigView.from_values(values)))


def as_shipped(value):
    """What a value becomes on the way: tuples are lists, a dtype its name."""
    if isinstance(value, (list, tuple)):
        return [as_shipped(item) for item in value]
    if isinstance(value, dict):
        return {key: as_shipped(item) for key, item in value.items()}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def assert_same_attributes(real, view, where: str = "config") -> None:
    values = hf_config_values(real)
    for name in values:
        expected, got = getattr(real, name), getattr(view, name)
        if hasattr(expected, "to_dict"):
            assert_same_attributes(expected, got, f"{where}.{name}")
        else:
            assert got == as_shipped(expected), f"{where}.{name}: {got!r} != {expected!r}"
    for name in ("vocab_size", "hidden_size", "num_attention_heads", "architectures",
                 "model_type"):
        assert name in values, f"{where} lacks {name}"
    with pytest.raises(AttributeError):
        view.no_such_attribute  # noqa: B018 — getattr(view, name, default) reads as it did
    assert getattr(view, "no_such_attribute", 7) == 7


@pytest.mark.parametrize("family", FAMILIES)
def test_values_drive_the_model_as_the_transformers_config_does(checkpoints, family):
    path = checkpoints[family]
    real = load_hf_config(path)
    view = shipped(hf_config_values(real))
    assert_same_attributes(real, view)
    for name, alias in (getattr(type(real), "attribute_map", None) or {}).items():
        assert getattr(view, name) == getattr(real, alias)  # e.g. num_local_experts
    logits = []
    for config in (real, view):
        torch.manual_seed(0)
        model = load_model(path, config, dtype=torch.float32)
        driver = PagedDriver(model, num_blocks=16, block_size=4)
        logits.append(driver.step([(0, [5, 9, 3, 7, 11, 2], 6), (1, [4, 8, 6], 3)]))
    assert torch.equal(logits[0], logits[1])


def test_from_args_ships_the_values_and_the_ranks_read_them(checkpoints):
    path = checkpoints["qwen3_moe"]
    config = make_engine_config(path, max_model_len=64, kv_cache_memory_bytes=2**20,
                                skip_tokenizer_init=True)
    assert config.model.hf_config is not None
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    view = model_hf_config(decoded.model)
    assert isinstance(view, HFConfigView)
    assert_same_attributes(load_hf_config(path), view)
    assert decoded == config and "hf_config=" not in repr(config.model)  # not compared, not shown
    # Built without them (a hand-made ModelConfig): the rank reads the checkpoint itself.
    assert not isinstance(model_hf_config(dataclasses.replace(config.model, hf_config=None)),
                          HFConfigView)


def test_a_draft_models_values_ship_too(checkpoints):
    target, draft = checkpoints["llama"], checkpoints["llama_tied_rope3"]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    config = make_engine_config(target, max_model_len=64, kv_cache_memory_bytes=2**20,
                                skip_tokenizer_init=True, speculative_config=spec)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    view = model_hf_config(decoded.speculative)
    assert isinstance(view, HFConfigView)
    assert_same_attributes(load_hf_config(draft), view)
    with pytest.raises(ValueError, match="unknown keys \\['hf_config'\\]"):
        make_engine_config(target, skip_tokenizer_init=True,
                           speculative_config={**spec, "hf_config": {}})
