"""--quantization wint8 / wint4 reach each family's vision tower through the model
loader: the blocks' linears (attention and MLP) hold the quantized form, as the
decoder's do, and the tower still gives rows; the patch embeddings, mergers and
projectors stay in the model's dtype. (That a quantized block computes with exactly its
dequantized weights: tests/model/test_vision_qwen2_5_vl.py.)"""

from __future__ import annotations

import pytest
import torch

import vlm_checkpoints

from loom.model.layers.linear import LinearBase
from loom.model.loader.hf_config import load_hf_config
from loom.model.loader.model_loader import load_model

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "ernie4_5_vl", "gemma3_vl", "smolvlm", "paddleocr_vl")
# the module of each family's model that holds its tower
TOWERS = {"qwen2_5_vl": "visual", "qwen3_vl": "visual", "ernie4_5_vl": "vision_tower",
          "gemma3_vl": "vision", "smolvlm": "vision", "paddleocr_vl": "visual"}
# a block's linear layer names end with one of these
BLOCK_LINEARS = ("qkv", "qkv_proj", "proj", "out_proj", "gate_up_proj", "down_proj", "fc1",
                 "fc2", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize("family,quantization", [
    *((family, "wint8") for family in FAMILIES),
    # (the tiny ERNIE 4.5 VL's text experts have 16 input features: no wint4 group fits)
    *((family, "wint4") for family in FAMILIES if family != "ernie4_5_vl")])
def test_the_towers_blocks_hold_the_quantized_form(tmp_path, family, quantization):
    path = getattr(vlm_checkpoints, f"make_tiny_{family}")(tmp_path / family)
    model = load_model(path, load_hf_config(path), dtype=torch.float32,
                       quantization=quantization, quantization_group_size=32)
    tower = getattr(model, TOWERS[family])
    held = {name: module.quantization for name, module in tower.named_modules()
            if isinstance(module, LinearBase)}
    in_blocks = {name: method for name, method in held.items()
                 if (".blocks." in f".{name}" or ".layers." in f".{name}")
                 and name.rsplit(".", 1)[-1] in BLOCK_LINEARS}
    assert in_blocks and set(in_blocks.values()) == {quantization}, held
    assert {method for name, method in held.items() if name not in in_blocks} == {"none"}
