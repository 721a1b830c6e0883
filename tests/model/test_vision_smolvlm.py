"""SmolVLM's vision tower (loom/model/vision/smolvlm.py) gives the rows of transformers'
``get_image_features`` on tiles from SmolVLM's own image processor: a batch whose
samples have different numbers of tiles (the shorter padded with all-zero tiles, which
make no rows), one image alone, and tiles with padded pixels (their real patches spread
over the position table, the padded ones no key)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm_checkpoints import load_tower

from loom.model.vision.smolvlm import SmolVLMVisionTower

TILE = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, the checkpoint's tower tensors relative to ``model.``, HF model, the
    processor's output for two images of 2 x 2 and 1 x 2 tiles, as a batch of two)."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil

    config = SmolVLMConfig(
        text_config={"model_type": "llama", "hidden_size": 48, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": 300},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": TILE, "patch_size": 4},
        scale_factor=2, image_token_id=299)
    torch.manual_seed(0)
    model = SmolVLMForConditionalGeneration(config).eval()
    with torch.no_grad():  # off HF's unit norms and zero biases
        for module in (model.model.vision_model, model.model.connector):
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("smolvlm_vision")
    model.save_pretrained(path)
    weights = {name[len("model."):]: tensor
               for name, tensor in load_file(path / "model.safetensors").items()
               if name.startswith(("model.vision_model.", "model.connector."))}
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((60, 60), (30, 70))]
    processor = SmolVLMImageProcessorPil(size={"longest_edge": 2 * TILE},
                                         max_image_size={"longest_edge": TILE})
    batch = processor(images=[[images[0]], [images[1]]], return_tensors="pt")
    return config, weights, model, batch


def build_tower(config, weights: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32) -> SmolVLMVisionTower:
    """As the model loader does: build in ``dtype``, load, run the layers' hooks."""
    return load_tower(SmolVLMVisionTower, config, weights, dtype)


def hf_rows(model, pixel_values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, mask).pooler_output
    return torch.cat(features)


def test_saved_names(tiny):
    _, weights, _, _ = tiny
    assert "vision_model.encoder.layers.0.self_attn.q_proj.weight" in weights
    assert "connector.modality_projection.proj.weight" in weights


def test_matches_hf_float32(tiny):
    config, weights, model, batch = tiny
    pixel_values, mask = batch["pixel_values"], batch["pixel_attention_mask"]
    assert pixel_values.shape[:2] == (2, 5)  # 2 x 2 tiles + global; 1 x 2 + global, padded
    assert not pixel_values[1, 3:].any()
    tower = build_tower(config, weights)
    expected = hf_rows(model, pixel_values, mask)
    rows_per_tile = (TILE // 4) ** 2 // 4
    with torch.no_grad():
        both = tower(pixel_values, mask)
        alone = tower(pixel_values[1, :3], None)
    assert both.shape == ((5 + 3) * rows_per_tile, config.text_config.hidden_size)
    assert both.dtype == torch.float32
    torch.testing.assert_close(both, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, expected[5 * rows_per_tile:], atol=1e-5, rtol=1e-5)


def test_padded_pixels_match_hf(tiny):
    """Tiles whose bottom and right pixels are padding (5 x 6 and 8 x 3 real patches)."""
    config, weights, model, batch = tiny
    pixel_values = batch["pixel_values"][0, :2].clone()
    mask = torch.ones(2, TILE, TILE, dtype=torch.int64)
    mask[0, 20:], mask[0, :, 24:], mask[1, :, 12:] = 0, 0, 0
    pixel_values *= mask[:, None]
    expected = hf_rows(model, pixel_values[None], mask[None])
    with torch.no_grad():
        rows = build_tower(config, weights)(pixel_values, mask)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close(tiny):
    config, weights, model, batch = tiny
    pixel_values, mask = batch["pixel_values"], batch["pixel_attention_mask"]
    with torch.no_grad():
        rows = build_tower(config, weights, torch.bfloat16)(pixel_values, mask)
    assert rows.dtype == torch.bfloat16
    expected = hf_rows(model, pixel_values, mask)
    scale = expected.abs().max()
    torch.testing.assert_close(rows.float() / scale, expected / scale, atol=3e-2, rtol=0)
