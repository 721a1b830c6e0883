"""Qwen3-VL's vision tower gives transformers' rows: the merged image embeddings and the
deepstack features, side by side, for images its own image processor made."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.vision.qwen3_vl import Qwen3VLVisionTower

PREFIX = "model.visual."
DEEPSTACK = [0, 1]
OUT_HIDDEN = 48
# (width, height): two of different sizes in one batch, then the first alone
SIZES = [(300, 200), (90, 260)]


def tiny_config():
    from transformers import Qwen3VLConfig

    text = {"vocab_size": 128, "hidden_size": OUT_HIDDEN, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                "mrope_section": [4, 4, 4],
                                                "mrope_interleaved": True}}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": OUT_HIDDEN, "num_position_embeddings": 36,
              "deepstack_visual_indexes": DEEPSTACK, "patch_size": 16,
              "temporal_patch_size": 2, "spatial_merge_size": 2,
              "hidden_act": "gelu_pytorch_tanh"}
    return Qwen3VLConfig(text_config=text, vision_config=vision)


def image_processor():
    """What Qwen3VLProcessor uses for images, with the checkpoints' own settings
    (Qwen/Qwen3-VL-*'s preprocessor_config.json)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
        temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5])


def tiny_model():
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config()).float().eval()
    # every vision weight random, biases and norms too (the initializer zeroes biases):
    # rows of order one, in which a misplaced term shows
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            scale = 0.5 if "pos_embed" in name else 1 / param.shape[-1] ** 0.5
            offset = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            param.copy_(offset + scale * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model()


@pytest.fixture(scope="module")
def batches():
    """The processor's (pixel_values, image_grid_thw) of both images, and of the first."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in SIZES]
    processor = image_processor()
    return [(out["pixel_values"], out["image_grid_thw"])
            for out in (processor(images, return_tensors="pt"),
                        processor(images[:1], return_tensors="pt"))]


def hf_rows(model, pixel_values, grid_thw) -> torch.Tensor:
    """transformers' image features: | merged | deepstack 0 | deepstack 1 |, image by image."""
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, grid_thw)
    levels = [out.pooler_output, *out.deepstack_features]
    return torch.cat([torch.cat(level) for level in levels], dim=-1)


def build_tower(model, dtype: torch.dtype, tp_group: TPGroup = SINGLE) -> Qwen3VLVisionTower:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        tower = Qwen3VLVisionTower(model.config, tp_group)
    finally:
        torch.set_default_dtype(previous)
    weights = [(name[len(PREFIX):], tensor) for name, tensor in model.state_dict().items()
               if name.startswith(PREFIX)]
    loaded = tower.load_weights(weights)
    assert loaded == {name for name, _ in tower.named_parameters()}
    for module in tower.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    return tower


def test_rows_match_transformers(hf_model, batches):
    tower = build_tower(hf_model, torch.float32)
    (pixels, grids), (pixels_one, grids_one) = batches
    assert grids.tolist() != [grids[0].tolist()] * 2  # two sizes
    with torch.no_grad():
        rows = tower(pixels, grids)
        rows_one = tower(pixels_one, grids_one)
    num_tokens = int(grids.prod(-1).sum()) // 4
    assert rows.shape == (num_tokens, OUT_HIDDEN * (1 + len(DEEPSTACK)))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, hf_rows(hf_model, pixels, grids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows_one, hf_rows(hf_model, pixels_one, grids_one),
                               atol=1e-5, rtol=1e-5)
    # an image's rows do not depend on what it is batched with
    torch.testing.assert_close(rows[:len(rows_one)], rows_one, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close(hf_model, batches):
    tower = build_tower(hf_model, torch.bfloat16)
    pixels, grids = batches[0]
    with torch.no_grad():
        rows = tower(pixels, grids)
    assert rows.dtype == torch.bfloat16
    expected = hf_rows(hf_model, pixels, grids)
    torch.testing.assert_close(rows.float(), expected, atol=0.05, rtol=0.05)
    cosine = torch.nn.functional.cosine_similarity(rows.float(), expected, dim=-1)
    assert cosine.min() > 0.99


@dataclass
class _Exchange:
    """Where ranks running as threads of one process meet for a collective."""

    world_size: int
    parts: list = field(default_factory=list)
    barrier: threading.Barrier | None = None

    def __post_init__(self) -> None:
        self.parts = [None] * self.world_size
        self.barrier = threading.Barrier(self.world_size)

    def gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = tensor.clone()
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()  # nobody writes the next collective's part before all read
        return parts


@dataclass(frozen=True, eq=False)
class _ThreadTPGroup(TPGroup):
    exchange: _Exchange | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.copy_(sum(self.exchange.gather(self.rank, tensor)))

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.exchange.gather(self.rank, tensor), dim=dim)


def test_tensor_parallel_matches_one_rank(hf_model, batches):
    """Two ranks, each with one of the two heads and half of each MLP, give one rank's rows."""
    pixels, grids = batches[0]
    exchange = _Exchange(2)
    towers = [build_tower(hf_model, torch.float32, _ThreadTPGroup(rank, 2, None, exchange))
              for rank in range(2)]
    assert towers[1].blocks[0].attn.num_heads == 1
    results: list[torch.Tensor | BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                results[rank] = towers[rank](pixels, grids)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            exchange.barrier.abort()
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    expected = hf_rows(hf_model, pixels, grids)
    for result in results:
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=1e-5)


def test_images_in_passes_of_bounded_rows_change_no_bit(hf_model, batches, monkeypatch):
    """Images go through the blocks in passes of at most ``PASS_ROWS`` patches (an image
    of more alone), the rope rotating ``ROPE_ROWS`` rows at a time: the rows, deepstack
    levels included, are bit for bit those of one pass and one rotation over them all."""
    import loom.model.vision as vision

    (pixels, grids), (pixels_one, grids_one) = batches
    pixels, grids = torch.cat([pixels, pixels_one]), torch.cat([grids, grids_one])
    first, second, third = grids.prod(-1).tolist()
    tower = build_tower(hf_model, torch.bfloat16)
    passes = []
    real_pass = tower._pass
    monkeypatch.setattr(tower, "_pass", lambda p, g: passes.append(
        [t * h * w for t, h, w in g]) or real_pass(p, g))
    with torch.no_grad():
        monkeypatch.setattr(vision, "ROPE_ROWS", 1 << 30)
        expected = tower(pixels, grids)
        monkeypatch.setattr(vision, "ROPE_ROWS", 5)
        outputs = {}
        for rows in (first + second, first + second - 1, 1):
            monkeypatch.setattr(vision, "PASS_ROWS", rows)
            outputs[rows] = tower(pixels, grids)
    assert passes == [[first, second, third], [first, second], [third],
                      [first], [second], [third], [first], [second], [third]]
    assert expected.shape[-1] == OUT_HIDDEN * (1 + len(DEEPSTACK))
    for rows in outputs.values():
        assert torch.equal(rows, expected)
