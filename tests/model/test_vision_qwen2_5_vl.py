"""Qwen2.5-VL's vision tower gives the rows of transformers' ``get_image_features``.

A tiny random Qwen2_5_VLForConditionalGeneration (float32, seeded): 3 vision blocks, the
middle one full attention, the others in windows of 56 pixels (2 x 2 merge units), so a
56 x 84 image splits into 2 windows and a 112 x 112 one into 4. Images go through the
checkpoint's own PIL image processor. transformers is imported inside the tests only:
the tensor-parallel ranks import this module and need none of it.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_checkpoints import load_tower

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.loader.hf_config_values import HFConfigView, hf_config_values
from loom.model.vision.qwen2_5_vl import Qwen2_5_VLVisionTower, _WindowLayout

IMAGE_SIZES = ((56, 84), (112, 112))  # (height, width) in pixels


def build_tower(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                tp_group: TPGroup = SINGLE) -> Qwen2_5_VLVisionTower:
    """As the model loader does: build in ``dtype``, load, run the layers' hooks."""
    return load_tower(Qwen2_5_VLVisionTower, config, state_dict, dtype, tp_group)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 40, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
                     "bos_token_id": None, "eos_token_id": None},
        vision_config={"depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
                       "out_hidden_size": 40, "window_size": 56, "fullatt_block_indexes": [1]})
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights of unit-scale outputs (the init's are near zero)
        for param in model.model.visual.parameters():
            if param.dim() == 1:  # norms and biases
                param.add_(torch.randn_like(param) * 0.2)
            else:
                param.copy_(torch.randn_like(param) / param[0].numel() ** 0.5)
    return model


@pytest.fixture(scope="module")
def visual_weights(hf_model) -> dict[str, torch.Tensor]:
    """The tower's tensors as a checkpoint names them under its ``visual.`` prefix."""
    return dict(hf_model.model.visual.state_dict())


@pytest.fixture(scope="module")
def images() -> dict[str, dict[str, torch.Tensor]]:
    """The processor's pixel_values and image_grid_thw for both images in one batch
    (``pair``) and for the second alone (``alone``)."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                for height, width in IMAGE_SIZES]
    processor = Qwen2VLImageProcessorPil()
    return {"pair": dict(processor(images=pictures, return_tensors="pt")),
            "alone": dict(processor(images=pictures[1:], return_tensors="pt"))}


def hf_rows(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"],
                                                  batch["image_grid_thw"])
    return torch.cat(features.pooler_output)


def test_window_layout_is_transformers(images):
    """Row order, windows, frames and rope positions as transformers' vision_utils make
    them, for the test's grids and for a 2-frame grid that no window divides."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    assert images["pair"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]
    for grid_thw in (images["pair"]["image_grid_thw"], torch.tensor([[2, 6, 10], [1, 2, 2]])):
        layout = _WindowLayout.of_grids(grid_thw, merge=2, window_units=2,
                                        device=torch.device("cpu"))
        window_index, cu_window_seqlens = get_vision_window_index(
            grid_thw, spatial_merge_size=2, window_size=56, patch_size=14)
        assert layout.unit_order.tolist() == window_index.tolist()
        positions = get_vision_position_ids(grid_thw, 2)
        assert layout.positions.tolist() == positions[layout.patch_order].tolist()
        for segments, cu_seqlens in ((layout.windows, cu_window_seqlens),
                                     (layout.frames, get_vision_cu_seqlens(grid_thw))):
            spans = sorted((int(rows[0]), int(rows[-1]) + 1)
                           for group in segments.groups for rows in group)
            bounds = cu_seqlens.tolist()
            assert spans == list(itertools.pairwise(bounds))
    pair = _WindowLayout.of_grids(images["pair"]["image_grid_thw"], 2, 2, torch.device("cpu"))
    assert sum(len(group) for group in pair.windows.groups) == 2 + 4


def test_segments_that_follow_one_another_are_runs():
    """A group of equal spans one after another is a run (first row, spans, length),
    which attention reads as a view; spans with others between them are gathered."""
    from loom.model.vision.qwen2_5_vl import _Segments

    cpu = torch.device("cpu")
    assert _Segments.of_lengths([4, 4, 2], cpu).runs == ((0, 2, 4), (8, 1, 2))
    split = _Segments.of_lengths([4, 2, 4], cpu)
    assert split.runs == (None, (4, 1, 2))
    assert split.groups[0].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]


def test_rope_in_row_chunks_and_attention_views_change_no_bit(hf_model, visual_weights,
                                                               images, monkeypatch):
    """The rope rotates a few rows at a time and SDPA reads runs of spans as views: the
    rows are bit for bit those of the rope over every row at once and of gathering every
    span (the pair's windows hold both a run and a gathered group). (SDPA's path: bf16
    on an AVX512-BF16 CPU takes loom's segment_attention kernel instead, tested below.)"""
    from loom.model.vision import qwen2_5_vl

    inputs = images["pair"]
    tower = build_tower(hf_model.config, visual_weights, dtype=torch.bfloat16)
    monkeypatch.setattr(qwen2_5_vl, "native_attention_within", lambda *args: None)
    with torch.no_grad():
        monkeypatch.setattr(qwen2_5_vl, "_ROPE_ROWS", 5)  # 88 rows: 18 chunks, one short
        rows = tower(inputs["pixel_values"], inputs["image_grid_thw"])
        monkeypatch.setattr(qwen2_5_vl, "_ROPE_ROWS", 1 << 30)
        real_of_lengths = qwen2_5_vl._Segments.of_lengths.__func__

        def gathered(cls, lengths, device):
            segments = real_of_lengths(cls, lengths, device)
            return cls(segments.groups, (None,) * len(segments.groups), segments.lengths)
        monkeypatch.setattr(qwen2_5_vl._Segments, "of_lengths", classmethod(gathered))
        expected = tower(inputs["pixel_values"], inputs["image_grid_thw"])
    assert torch.equal(rows, expected)


def test_native_attention_within_segments_is_sdpas_up_to_rounding(hf_model, visual_weights,
                                                                    images, monkeypatch):
    """bf16 on the CPU, the tower's windows and images take loom's segment_attention
    kernel where the CPU has AVX512-BF16: its rows are SDPA's to within bf16 rounding."""
    from loom.kernels import native_ops
    from loom.model.vision import qwen2_5_vl

    if not native_ops().segment_attention_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    inputs = images["pair"]
    tower = build_tower(hf_model.config, visual_weights, dtype=torch.bfloat16)
    calls = []
    real = qwen2_5_vl.native_attention_within
    monkeypatch.setattr(qwen2_5_vl, "native_attention_within",
                        lambda *args: calls.append(1) or real(*args))
    with torch.no_grad():
        rows = tower(inputs["pixel_values"], inputs["image_grid_thw"])
        assert len(calls) == len(tower.blocks)
        monkeypatch.setattr(qwen2_5_vl, "native_attention_within", lambda *args: None)
        expected = tower(inputs["pixel_values"], inputs["image_grid_thw"])
    torch.testing.assert_close(rows.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_images_in_passes_of_bounded_rows_change_no_bit(hf_model, visual_weights, images,
                                                       monkeypatch):
    """Images go through the blocks in passes of at most ``PASS_ROWS`` patches (an image
    of more alone): the rows are bit for bit those of one pass over them all."""
    import loom.model.vision

    pair, alone = images["pair"], images["alone"]  # 24 + 64 patches, 64
    pixels = torch.cat([pair["pixel_values"], alone["pixel_values"]])
    grid = torch.cat([pair["image_grid_thw"], alone["image_grid_thw"]])
    tower = build_tower(hf_model.config, visual_weights, dtype=torch.bfloat16)
    passes = []
    real_pass = tower._pass
    monkeypatch.setattr(tower, "_pass", lambda p, g: passes.append(g[:, 1:].prod(-1).tolist())
                        or real_pass(p, g))
    with torch.no_grad():
        expected = tower(pixels, grid)
        outputs = {}
        for rows in (88, 63, 1):
            monkeypatch.setattr(loom.model.vision, "PASS_ROWS", rows)
            outputs[rows] = tower(pixels, grid)
    assert passes == [[24, 64, 64], [24, 64], [64], [24], [64], [64], [24], [64], [64]]
    for rows in outputs.values():
        assert torch.equal(rows, expected)


@pytest.mark.parametrize("batch", ["pair", "alone"])
def test_matches_transformers(hf_model, visual_weights, images, batch):
    tower = build_tower(hf_model.config, visual_weights)
    inputs = images[batch]
    expected = hf_rows(hf_model, inputs)
    with torch.no_grad():
        rows = tower(inputs["pixel_values"], inputs["image_grid_thw"])
    grid_thw = inputs["image_grid_thw"]
    assert rows.shape == (int(grid_thw.prod(-1).sum()) // 4, 40)
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close(hf_model, visual_weights, images):
    tower = build_tower(hf_model.config, visual_weights, dtype=torch.bfloat16)
    inputs = images["pair"]
    with torch.no_grad():
        rows = tower(inputs["pixel_values"], inputs["image_grid_thw"])
    assert rows.dtype == torch.bfloat16
    expected = hf_rows(hf_model, inputs)
    torch.testing.assert_close(rows.float(), expected, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("quantization", ["wint8", "wint4:32"])
def test_quantized_blocks_equal_their_dequantized_weights(hf_model, visual_weights, images,
                                                          quantization):
    """--quantization quantizes the tower's blocks as the decoder's: each linear whose
    input features its blocks divide holds the quantized form (the others, here the
    48-wide MLP output, stay float32), and the tower's rows equal the same tower holding
    those weights dequantized."""
    from loom.model.layers.linear import LinearBase

    quantized = load_tower(Qwen2_5_VLVisionTower, hf_model.config, visual_weights,
                           quantization=quantization)
    plain = build_tower(hf_model.config, visual_weights)
    held = {}
    for name, module in quantized.named_modules():
        if isinstance(module, LinearBase):
            held[name] = module.quantization
            if module.quantization != "none":
                dict(plain.named_modules())[name].weight.data.copy_(
                    module.form.dequantize(torch.float32))
    assert held["blocks.0.attn.qkv"] == held["blocks.0.mlp.gate_up_proj"] == \
        quantization.split(":")[0]
    assert held["blocks.0.mlp.down_proj"] == "none"  # 48 input features
    assert held["patch_embed.proj"] == held["merger.mlp.0"] == "none"
    inputs = images["pair"]
    with torch.no_grad():
        rows = quantized(inputs["pixel_values"], inputs["image_grid_thw"])
        expected = plain(inputs["pixel_values"], inputs["image_grid_thw"])
        unquantized = build_tower(hf_model.config, visual_weights)(
            inputs["pixel_values"], inputs["image_grid_thw"])
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rows, unquantized, atol=1e-3)  # the weights did change


def test_refuses_pixels_that_do_not_fit_the_grid(hf_model, visual_weights, images):
    tower = build_tower(hf_model.config, visual_weights)
    inputs = images["pair"]
    with pytest.raises(ValueError, match="makes 88 patches but pixel_values has 64 rows"):
        tower(inputs["pixel_values"][:64], inputs["image_grid_thw"])


def _tp_worker(rank: int, world_size: int, store_path: str, config: HFConfigView,
               inputs_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world_size)
    try:
        weights, inputs = torch.load(inputs_path)
        tower = build_tower(config, weights, tp_group=TPGroup(rank, world_size,
                                                              dist.group.WORLD))
        with torch.no_grad():
            rows = tower(inputs["pixel_values"], inputs["image_grid_thw"])
        if rank == 0:
            torch.save(rows, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel.py's ranks leave (no gloo teardown at exit)


def test_tp2_matches_tp1(hf_model, visual_weights, images, tmp_path):
    """Two gloo ranks, one head, half the MLP and half the merger each, built from the
    plain-values config a rank receives (HFConfigView)."""
    config = HFConfigView.from_values(hf_config_values(hf_model.config))
    inputs_path, out_path = str(tmp_path / "inputs.pt"), str(tmp_path / "rows.pt")
    torch.save((visual_weights, images["pair"]), inputs_path)
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), config, inputs_path, out_path),
             nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out_path), hf_rows(hf_model, images["pair"]),
                               atol=1e-5, rtol=1e-5)
