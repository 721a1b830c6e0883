"""ERNIE 4.5 VL's vision tower gives the rows transformers' get_image_features gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm_checkpoints import load_tower, outputs_in_passes

from loom.model.loader.hf_config_values import HFConfigView, hf_config_values
from loom.model.vision.ernie4_5_vl import Ernie4_5_VLVisionTower, patch_positions

PATCH_SIZE = 14
# (width, height): grids (1, 4, 6) and (1, 8, 6) after the processor's resize
IMAGE_SIZES = [(84, 56), (84, 112)]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import (
        Ernie4_5_VLMoeConfig,
        Ernie4_5_VLMoeForConditionalGeneration,
    )

    config = Ernie4_5_VLMoeConfig(
        text_config={"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                     "moe_intermediate_size": [16, 16], "moe_num_experts": 2, "moe_k": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                         "mrope_section": [2, 2, 2]}},
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64,
                       "patch_size": PATCH_SIZE})
    torch.manual_seed(0)
    model = Ernie4_5_VLMoeForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms' weights and biases away from 1 and 0 too
        for name, param in model.named_parameters():
            if "vision_tower" in name or "resampler_model" in name:
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("ernie4_5_vl")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tower_weights(hf_model) -> list[tuple[str, torch.Tensor]]:
    """The tower's tensors as the saved checkpoint names them, relative to ``model.``."""
    from safetensors.torch import load_file

    _, path = hf_model
    tensors = load_file(str(path / "model.safetensors"))
    return [(name.removeprefix("model."), tensor) for name, tensor in tensors.items()
            if name.startswith(("model.vision_model.", "model.resampler_model."))]


def loom_tower(hf_config, weights, dtype: torch.dtype) -> Ernie4_5_VLVisionTower:
    return load_tower(Ernie4_5_VLVisionTower,
                      HFConfigView.from_values(hf_config_values(hf_config)), weights, dtype)


def preprocess(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image
    from transformers import Ernie4_5_VLMoeImageProcessorPil

    processor = Ernie4_5_VLMoeImageProcessorPil(
        patch_size=PATCH_SIZE, size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    batch = processor(images=images, return_tensors="pt")
    return batch["pixel_values"], batch["image_grid_thw"]


def hf_image_rows(model, pixel_values, grid_thw) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
    return torch.cat(out.pooler_output)


@pytest.mark.parametrize("sizes", [IMAGE_SIZES, IMAGE_SIZES[1:]], ids=["two", "one"])
def test_matches_hf_float32(hf_model, tower_weights, sizes):
    model, _ = hf_model
    pixel_values, grid_thw = preprocess(sizes)
    assert grid_thw.tolist() == [[1, h // PATCH_SIZE, w // PATCH_SIZE] for w, h in sizes]
    tower = loom_tower(model.config, tower_weights, torch.float32)
    with torch.no_grad():
        rows = tower(pixel_values, grid_thw)
    # an image of grid (1, h, w) takes h * w / 4 placeholder tokens
    assert rows.shape == (int(grid_thw.prod(-1).sum()) // 4, model.config.text_config.hidden_size)
    torch.testing.assert_close(rows, hf_image_rows(model, pixel_values, grid_thw),
                               atol=1e-5, rtol=1e-5)


def test_video_frames_pair_as_hf(hf_model, tower_weights):
    """Frames (0, 1), (2, 3) of a video make one row per 2x2 block each."""
    model, _ = hf_model
    grid_thw = torch.tensor([[4, 4, 6], [2, 2, 4]])
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 3 * PATCH_SIZE ** 2,
                               generator=torch.Generator().manual_seed(1))
    tower = loom_tower(model.config, tower_weights, torch.float32)
    with torch.no_grad():
        rows = tower(pixel_values, grid_thw)
        expected = torch.cat(model.model.get_video_features(
            pixel_values, grid_thw, return_dict=True).pooler_output)
    assert rows.shape[0] == 2 * 6 + 1 * 2
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32(hf_model, tower_weights):
    model, _ = hf_model
    pixel_values, grid_thw = preprocess(IMAGE_SIZES)
    with torch.no_grad():
        reference = loom_tower(model.config, tower_weights, torch.float32)(pixel_values, grid_thw)
        rows = loom_tower(model.config, tower_weights, torch.bfloat16)(pixel_values, grid_thw)
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=2e-2, rtol=2e-2)


def test_patch_positions_follow_merge_blocks():
    positions = patch_positions([[1, 2, 4]], merge_size=2)
    assert positions[:, 0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert positions[:, 1].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]


def test_images_in_passes_of_bounded_rows_change_no_bit(hf_model, tower_weights, monkeypatch):
    """Images and videos go through the blocks and the resampler in passes of at most
    ``PASS_ROWS`` patches (one larger alone): bit for bit the rows of one pass."""
    model, _ = hf_model
    image_pixels, image_grid = preprocess(IMAGE_SIZES)
    video_grid = torch.tensor([[2, 2, 4]])
    video_pixels = torch.randn(16, 3 * PATCH_SIZE ** 2, generator=torch.Generator().manual_seed(2))
    pixels = torch.cat([image_pixels, video_pixels])
    grid = torch.cat([image_grid, video_grid])
    first, second, third = grid.prod(-1).tolist()
    tower = loom_tower(model.config, tower_weights, torch.bfloat16)
    expected, outputs, passes = outputs_in_passes(monkeypatch, tower, tower.vision_model, pixels,
                                                  grid, [first + second, first, 1])
    assert passes == [[first, second, third], [first, second], [third],
                      [first], [second], [third], [first], [second], [third]]
    for rows in outputs:
        assert torch.equal(rows, expected)
