"""Tiny random vision-language checkpoints, with a tokenizer, a chat template and the
family's image processor config beside them, built offline.

The tokenizer is the tiny byte-level one (tokenizer_fixtures.py) with the family's image
tokens added after its 256 ids; the chat template is ChatML whose image parts (``{"type":
"image"}``, as loom passes OpenAI's ``image_url`` parts) write the family's placeholder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch
from tokenizer_fixtures import _move_chat_template_into_tokenizer_config, make_tiny_tokenizer

QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = 256, 257, 258, 259
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_BUILT: dict[str, str] = {}


def randomize(model, final_norm) -> None:
    """Weights drawn as tests/model/checkpoints.py draws the text families': random norms,
    and the final norm scaled by 8 for sharp logits (decisive greedy comparisons)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_q.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
        final_norm.weight.mul_(8.0)


def qwen2_5_vl_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]}),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            window_size=56, fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2),
        image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


def make_tiny_qwen2_5_vl(path: str | os.PathLike) -> str:
    """A tiny random Qwen2.5-VL (float32, seeded) in ``path``: text 2 layers of 64, vision
    2 blocks of 32 (the second full attention, the first in 56-pixel windows); images of
    56 x 56 to 224 x 224 pixels (4 to 64 rows each)."""
    path = str(path)
    if "qwen2_5_vl" not in _BUILT:
        _BUILT["qwen2_5_vl"] = _build_qwen2_5_vl()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["qwen2_5_vl"]):
        shutil.copyfile(os.path.join(_BUILT["qwen2_5_vl"], name), os.path.join(path, name))
    return path


def _build_qwen2_5_vl() -> str:
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-qwen2_5_vl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(2500)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config()).to(torch.float32)
    randomize(model, model.model.language_model.norm)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224).save_pretrained(path)
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    assert hf.convert_tokens_to_ids(QWEN_VL_TOKENS) == [VISION_START_ID, VISION_END_ID,
                                                        IMAGE_PAD_ID, VIDEO_PAD_ID]
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, QWEN_VL_CHAT_TEMPLATE)
    return path


def qwen3_vl_config():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=264,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1], patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, hidden_act="gelu_pytorch_tanh"),
        image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


def make_tiny_qwen3_vl(path: str | os.PathLike) -> str:
    """A tiny random Qwen3-VL (float32, seeded) in ``path``: text 3 layers of 64 (qk-norm,
    interleaved M-RoPE), vision 2 blocks of 32, both deepstack levels (added after text
    layers 0 and 1); images of 32 x 32 to 128 x 128 pixels (1 to 16 rows each)."""
    path = str(path)
    if "qwen3_vl" not in _BUILT:
        _BUILT["qwen3_vl"] = _build_qwen3_vl()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["qwen3_vl"]):
        shutil.copyfile(os.path.join(_BUILT["qwen3_vl"], name), os.path.join(path, name))
    return path


def _build_qwen3_vl() -> str:
    from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-qwen3_vl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(3000)
    model = Qwen3VLForConditionalGeneration(qwen3_vl_config()).to(torch.float32)
    randomize(model, model.model.language_model.norm)
    with torch.no_grad():  # the tower's LayerNorms near one too, so its blocks count
        for name, param in model.model.visual.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    # the published checkpoints' settings (patch 16, mean and std 0.5), smaller images
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, patch_size=16,
        temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5]).save_pretrained(path)
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    assert hf.convert_tokens_to_ids(QWEN_VL_TOKENS) == [VISION_START_ID, VISION_END_ID,
                                                        IMAGE_PAD_ID, VIDEO_PAD_ID]
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, QWEN_VL_CHAT_TEMPLATE)
    return path
