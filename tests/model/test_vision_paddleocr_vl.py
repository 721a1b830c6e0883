"""PaddleOCR-VL's vision tower and projector (loom/model/vision/paddleocr_vl.py) give the
rows of transformers' ``get_image_features`` on images from PaddleOCR-VL's own image
processor: grids smaller and larger than the position table (5 x 5), so that it is
resampled down on one axis and up on the other."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_checkpoints import load_tower, outputs_in_passes

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.vision.paddleocr_vl import PaddleOCRVisionTower

# the checkpoint's tower prefixes -> the tower's own
PREFIXES = {"visual.": "", "mlp_AR.": "projector."}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, the tower's tensors under its own names, HF model, pixel values and
    grids of three images: 56x84 -> 4x6 patches, 112x112 -> 8x8, 30x200 -> 2x14)."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import PaddleOCRVLForConditionalGeneration
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import \
        PaddleOCRVLImageProcessorPil
    from vlm_checkpoints import paddleocr_vl_config  # not in the TP workers: slow to import

    config = paddleocr_vl_config()
    torch.manual_seed(0)
    model = PaddleOCRVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for module in (model.model.visual, model.model.projector):
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("paddleocr_vl_vision")
    model.save_pretrained(path)
    weights = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        for prefix, own in PREFIXES.items():
            if name.startswith(prefix):
                weights[own + name[len(prefix):]] = tensor
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((56, 84), (112, 112), (30, 200))]
    processor = PaddleOCRVLImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112})
    pixels = processor(images=images, return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8], [1, 2, 14]]
    return config, weights, model, pixels["pixel_values"], pixels["image_grid_thw"]


def build_tower(config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                tp_group: TPGroup = SINGLE) -> PaddleOCRVisionTower:
    """As the model loader does: build in ``dtype``, load, run the layers' hooks."""
    return load_tower(PaddleOCRVisionTower, config, weights, dtype, tp_group)


def hf_rows(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(pixel_values, grid_thw).pooler_output)


def test_matches_hf_float32(tiny):
    config, weights, model, pixel_values, grid_thw = tiny
    # the published checkpoint's tensors that neither transformers nor loom runs
    unused = {"vision_model.embeddings.packing_position_embedding.weight": torch.zeros(4, 32),
              "vision_model.head.probe": torch.zeros(1, 1, 32)}
    tower = build_tower(config, weights | unused)
    expected = hf_rows(model, pixel_values, grid_thw)
    second = slice(24, 24 + 64)  # the 8x8 image's patches
    with torch.no_grad():
        all_three = tower(pixel_values, grid_thw)
        alone = tower(pixel_values[second], grid_thw[1:2])
    assert all_three.shape == (6 + 16 + 7, config.text_config.hidden_size)
    assert all_three.dtype == torch.float32
    torch.testing.assert_close(all_three, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, expected[6:22], atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close(tiny):
    config, weights, model, pixel_values, grid_thw = tiny
    tower = build_tower(config, weights, torch.bfloat16)
    with torch.no_grad():
        rows = tower(pixel_values, grid_thw)
    assert rows.dtype == torch.bfloat16
    expected = hf_rows(model, pixel_values, grid_thw)
    scale = expected.abs().max()
    torch.testing.assert_close(rows.float() / scale, expected / scale, atol=3e-2, rtol=0)


def test_images_in_passes_of_bounded_rows_change_no_bit(tiny, monkeypatch):
    """Images go through the encoder and the projector in passes of at most
    ``PASS_ROWS`` patches (one larger alone): bit for bit the rows of one pass."""
    config, weights, _, pixel_values, grid_thw = tiny
    tower = build_tower(config, weights, torch.bfloat16)
    expected, outputs, passes = outputs_in_passes(monkeypatch, tower, tower.vision_model,
                                                  pixel_values, grid_thw, [24 + 64, 24 + 64 - 1, 1])
    assert passes == [[24, 64, 28], [24, 64], [28], [24], [64], [28], [24], [64], [28]]
    for rows in outputs:
        assert torch.equal(rows, expected)


def test_rejects_a_grid_of_partial_blocks(tiny):
    config, weights, _, pixel_values, _ = tiny
    tower = build_tower(config, weights)
    with pytest.raises(ValueError, match="not whole blocks"):
        tower(pixel_values[:3], torch.tensor([[1, 1, 3]]))


def _tp_worker(rank: int, world_size: int, store_path: str, tiny_parts, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size)
    try:
        config, weights, pixel_values, grid_thw = tiny_parts
        tower = build_tower(config, weights, tp_group=TPGroup(rank, world_size,
                                                              dist.group.WORLD))
        with torch.no_grad():
            rows = tower(pixel_values, grid_thw)
        if rank == 0:
            torch.save(rows, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel.py: no C++ teardown racing gloo's threads


def test_tp2_matches_tp1(tiny, tmp_path):
    """Two ranks, one head and half the MLP's and projector's features each, give the
    rows of one."""
    config, weights, _, pixel_values, grid_thw = tiny
    out_path = str(tmp_path / "rows.pt")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"),
                               (config, weights, pixel_values, grid_thw), out_path),
             nprocs=2, join=True)
    with torch.no_grad():
        expected = build_tower(config, weights)(pixel_values, grid_thw)
    torch.testing.assert_close(torch.load(out_path), expected, atol=1e-5, rtol=1e-5)
