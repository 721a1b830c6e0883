"""Gemma 3's vision tower (loom/model/vision/gemma3.py) gives the rows of transformers'
``get_image_features`` on images from Gemma 3's own image processor."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_checkpoints import load_tower

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.vision.gemma3 import Gemma3VisionTower

IMAGE_SIZE = 56  # a 4x4 grid of 14-pixel patches, pooled to 2x2 = mm_tokens_per_image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, the checkpoint's tower tensors as saved, HF model, pixel values of two
    images of different sizes)."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
    )

    config = Gemma3Config(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "vocab_size": 300},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": 14},
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF zero-initialises the projector and unit-initialises norms
        for module in (model.model.vision_tower, model.model.multi_modal_projector):
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(path)
    weights = {name: tensor for name, tensor in load_file(path / "model.safetensors").items()
               if name.startswith(("vision_tower.", "multi_modal_projector."))}
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((40, 70), (90, 60))]
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    return config, weights, model, pixel_values


def build_tower(config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                tp_group: TPGroup = SINGLE) -> Gemma3VisionTower:
    """As the model loader does: build in ``dtype``, load, run the layers' hooks."""
    return load_tower(Gemma3VisionTower, config, weights, dtype, tp_group)


def hf_rows(model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values).pooler_output
    return features.reshape(-1, features.shape[-1])  # (I * T * T, text hidden)


def test_saved_names(tiny):
    """transformers 5 saves the tower without SigLIP's ``vision_model.`` level and the
    pooling head that Gemma 3 never runs; the original files have the level."""
    _, weights, _, _ = tiny
    assert "multi_modal_projector.mm_input_projection_weight" in weights
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.weight" in weights
    assert any(name.startswith("vision_tower.head.") for name in weights)


@pytest.mark.parametrize("names", ["saved", "original"])
def test_matches_hf_float32(tiny, names):
    config, weights, model, pixel_values = tiny
    if names == "original":
        weights = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
                   for name, tensor in weights.items()}
    tower = build_tower(config, weights)
    expected = hf_rows(model, pixel_values)
    with torch.no_grad():
        both = tower(pixel_values, None)
        alone = tower(pixel_values[1:], None)
    assert both.shape == (2 * config.mm_tokens_per_image, config.text_config.hidden_size)
    assert both.dtype == torch.float32
    torch.testing.assert_close(both, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, expected[config.mm_tokens_per_image:],
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close(tiny):
    config, weights, model, pixel_values = tiny
    tower = build_tower(config, weights, torch.bfloat16)
    with torch.no_grad():
        rows = tower(pixel_values, None)
    assert rows.dtype == torch.bfloat16
    expected = hf_rows(model, pixel_values)
    scale = expected.abs().max()
    torch.testing.assert_close(rows.float() / scale, expected / scale, atol=3e-2, rtol=0)


def test_images_in_passes_of_bounded_rows_change_no_bit(tiny, monkeypatch):
    """Images go through the tower in passes of at most ``PASS_ROWS`` patches (at the
    checkpoint's 896 x 896, one image a pass): bit for bit the rows of one pass."""
    import loom.model.vision as vision

    config, weights, _, pixel_values = tiny
    tower = build_tower(config, weights, torch.bfloat16)
    patches = tower.vision_tower.grid_size ** 2
    calls = []
    real = tower.vision_tower.forward
    monkeypatch.setattr(tower.vision_tower, "forward",
                        lambda pixels: calls.append(pixels.shape[0]) or real(pixels))
    with torch.no_grad():
        monkeypatch.setattr(vision, "PASS_ROWS", 2 * patches)
        together = tower(pixel_values, None)
        monkeypatch.setattr(vision, "PASS_ROWS", patches)
        apart = tower(pixel_values, None)
    assert calls == [2, 1, 1]
    assert torch.equal(apart, together)


def test_rejects_a_wrong_image_size(tiny):
    config, weights, _, pixel_values = tiny
    tower = build_tower(config, weights)
    with pytest.raises(ValueError, match="preprocess them"):
        tower(pixel_values[:, :, :42, :42], None)


def _tp_worker(rank: int, world_size: int, store_path: str, tiny_parts, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size)
    try:
        config, weights, pixel_values = tiny_parts
        tower = build_tower(config, weights, tp_group=TPGroup(rank, world_size,
                                                              dist.group.WORLD))
        with torch.no_grad():
            rows = tower(pixel_values, None)
        if rank == 0:
            torch.save(rows, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel.py: no C++ teardown racing gloo's threads


def test_tp2_matches_tp1(tiny, tmp_path):
    """Two ranks, two heads and half the MLP's features each, give the rows of one."""
    config, weights, _, pixel_values = tiny
    out_path = str(tmp_path / "rows.pt")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), (config, weights, pixel_values),
                               out_path), nprocs=2, join=True)
    with torch.no_grad():
        expected = build_tower(config, weights)(pixel_values, None)
    torch.testing.assert_close(torch.load(out_path), expected, atol=1e-5, rtol=1e-5)
