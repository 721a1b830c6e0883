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
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
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
    layers 0 and 1); images of 32 x 32 to 128 x 128 pixels (1 to 16 rows each), videos
    of 2,048 to 65,536 pixels over all their frames."""
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
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

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
    # the video processor's (it imports beside loom's torch, runs only with torchvision):
    # a video's frames together between 2,048 and 65,536 pixels
    Qwen3VLVideoProcessor(
        size={"shortest_edge": 2048, "longest_edge": 16 * 64 * 64}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, cap_pixels_per_frame=False).save_pretrained(path)
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    assert hf.convert_tokens_to_ids(QWEN_VL_TOKENS) == [VISION_START_ID, VISION_END_ID,
                                                        IMAGE_PAD_ID, VIDEO_PAD_ID]
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, QWEN_VL_CHAT_TEMPLATE)
    return path


ERNIE_VL_TOKENS = ["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>",
                   "<|VIDEO_START|>", "<|VIDEO_END|>", "<|VIDEO_PLACEHOLDER|>"]
(ERNIE_IMAGE_START_ID, ERNIE_IMAGE_END_ID, ERNIE_IMAGE_ID, ERNIE_VIDEO_START_ID,
 ERNIE_VIDEO_END_ID, ERNIE_VIDEO_ID) = range(256, 262)
ERNIE_THINK_START_ID, ERNIE_THINK_END_ID = 262, 263  # <think>, </think>: text, not special
# the published template's turns ("User: ", "\nAssistant: "), numbered pictures and
# videos, and its thinking switch: the generation prompt opens <think> where
# enable_thinking is true, else writes it closed
ERNIE_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['system', 'user'] -%}"
    "{%- if message['role'] == 'user' -%}{{- 'User: ' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image_url', 'image'] -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{{- 'Picture ' ~ image_count.value ~ ':<|IMAGE_START|><|IMAGE_PLACEHOLDER|>"
    "<|IMAGE_END|>' -}}"
    "{%- elif part['type'] in ['video_url', 'video'] -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{{- 'Video ' ~ video_count.value ~ ':<|VIDEO_START|><|VIDEO_PLACEHOLDER|>"
    "<|VIDEO_END|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '\\nAssistant: ' + message['content'] + '<|end_of_sentence|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt is not defined or add_generation_prompt is true -%}"
    "{{- '\\nAssistant: ' -}}"
    "{%- if enable_thinking is defined and enable_thinking is true -%}{{- '<think>' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
# the video processor's settings (transformers' Ernie4_5_VLMoeVideoProcessor, saved as
# it saves them; it needs torchvision to be built), frames sized as images, timestamps
# drawn on them in Pillow's own font
ERNIE_VIDEO_FONT = "Aileron-Regular.ttf"
ERNIE_VIDEO_CONFIG = {
    "video_processor_type": "Ernie4_5_VLMoeVideoProcessor",
    "size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": True,
    "min_frames": 16, "max_frames": 180, "draw_on_frames": True, "font": ERNIE_VIDEO_FONT,
}


def ernie4_5_vl_config():
    from transformers import Ernie4_5_VLMoeConfig

    return Ernie4_5_VLMoeConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            moe_num_experts=4, moe_k=2, moe_intermediate_size=[32, 16],
            moe_num_shared_experts=2, mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [3, 3, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2),
        image_start_token_id=ERNIE_IMAGE_START_ID, image_end_token_id=ERNIE_IMAGE_END_ID,
        image_token_id=ERNIE_IMAGE_ID, video_start_token_id=ERNIE_VIDEO_START_ID,
        video_end_token_id=ERNIE_VIDEO_END_ID, video_token_id=ERNIE_VIDEO_ID)


def _randomize_ernie4_5_vl(model) -> None:
    """Wider weights than ``randomize`` (whose ERNIE repeats one token whatever the
    image): text 0.2, vision 0.3, norms about 1, the final norm times 4, so that the
    image, the 3D positions and the experts each move the greedy tokens. The embedding
    rows (the LM head's, tied) of the image and video markers and of <think> and </think>
    are scaled down, so that greedy decoding never writes one (a </think> in the output
    is a reasoning budget's)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "vision_tower." in name or "resampler_model." in name:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.2)
        model.model.language_model.norm.weight.mul_(4.0)
        model.model.language_model.embed_tokens.weight[ERNIE_IMAGE_START_ID:].mul_(0.05)


def make_tiny_ernie4_5_vl(path: str | os.PathLike) -> str:
    """A tiny random ERNIE 4.5 VL (float32, seeded) in ``path``: text 3 layers of 64 (a
    dense first layer, then text and vision experts, 4 each, top 2, two shared experts,
    3D rope on sections [3, 3, 2]), vision 2 blocks of 32; images and video frames of
    28 x 28 to 112 x 112 pixels after resizing (1 to 16 rows each, per frame pair for a
    video), timestamps drawn on the frames; a tokenizer with <think> and </think> and
    the published template's thinking switch."""
    path = str(path)
    if "ernie4_5_vl" not in _BUILT:
        _BUILT["ernie4_5_vl"] = _build_ernie4_5_vl()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["ernie4_5_vl"]):
        shutil.copyfile(os.path.join(_BUILT["ernie4_5_vl"], name), os.path.join(path, name))
    return path


def _build_ernie4_5_vl() -> str:
    import json

    from PIL import ImageFont
    from transformers import Ernie4_5_VLMoeForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import \
        Ernie4_5_VLMoeImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-ernie4_5_vl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(4500)
    model = Ernie4_5_VLMoeForConditionalGeneration(ernie4_5_vl_config()).to(torch.float32)
    _randomize_ernie4_5_vl(model)
    model.save_pretrained(path)
    Ernie4_5_VLMoeImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}).save_pretrained(path)
    with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
        json.dump(ERNIE_VIDEO_CONFIG, f, indent=2)
    with open(os.path.join(path, ERNIE_VIDEO_FONT), "wb") as f:
        f.write(ImageFont.load_default(size=10).font_bytes)
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": ERNIE_VL_TOKENS})
    hf.add_tokens(["<think>", "</think>"], special_tokens=False)
    assert hf.convert_tokens_to_ids(ERNIE_VL_TOKENS + ["<think>", "</think>"]) == \
        list(range(256, 264))
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, ERNIE_VL_CHAT_TEMPLATE)
    return path


# Gemma 3: its image tokens, then the turn markers of its chat template
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<start_of_turn>",
                 "<end_of_turn>"]
BOI_ID, IMAGE_SOFT_ID, EOI_ID = 256, 257, 258
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA3_IMAGE_SIZE = 112  # an 8x8 grid of 14-pixel patches, pooled 2x2 to 16 rows


def gemma3_vl_config():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=262,
            max_position_embeddings=1024, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            bos_token_id=None, eos_token_id=None, pad_token_id=0),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=GEMMA3_IMAGE_SIZE, patch_size=14),
        mm_tokens_per_image=16, boi_token_index=BOI_ID, image_token_index=IMAGE_SOFT_ID,
        eoi_token_index=EOI_ID)


def make_tiny_gemma3_vl(path: str | os.PathLike) -> str:
    """A tiny random Gemma 3 with images (float32, seeded) in ``path``: text 3 layers of 64
    (sliding, full, sliding; a window of 8, shorter than an image's 16 soft tokens),
    SigLIP 2 layers of 32 over 112 x 112 pixels, 16 rows per image."""
    path = str(path)
    if "gemma3_vl" not in _BUILT:
        _BUILT["gemma3_vl"] = _build_gemma3_vl()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["gemma3_vl"]):
        shutil.copyfile(os.path.join(_BUILT["gemma3_vl"], name), os.path.join(path, name))
    return path


def _build_gemma3_vl() -> str:
    from transformers import Gemma3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-gemma3_vl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(3300)
    model = Gemma3ForConditionalGeneration(gemma3_vl_config()).to(torch.float32)
    randomize(model, model.model.language_model.norm)
    with torch.no_grad():  # SigLIP's LayerNorms near one too, so its layers count
        for name, param in model.model.vision_tower.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE,
                                  "width": GEMMA3_IMAGE_SIZE}).save_pretrained(path)
    make_tiny_tokenizer(path)
    # named as Gemma's tokenizer names them, for transformers' Gemma3Processor
    hf = PreTrainedTokenizerFast.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>"})
    hf.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    assert hf.convert_tokens_to_ids(GEMMA3_TOKENS) == list(range(256, 261))
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, GEMMA3_CHAT_TEMPLATE)
    return path


# SmolVLM: its image tokens and its chat template's end-of-turn token (the published
# tokenizer's names), then the row/column markers of a tiled image (up to 2 x 2 tiles)
SMOLVLM_TILE_TOKENS = [f"<row_{row}_col_{col}>" for row in (1, 2) for col in (1, 2)]
SMOLVLM_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                  *SMOLVLM_TILE_TOKENS]
SMOLVLM_FAKE_ID, SMOLVLM_IMAGE_ID, SMOLVLM_GLOBAL_ID = 256, 257, 258
# the published template (Idefics3's): "User:<image>text<end_of_utterance>\nAssistant:"
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_TILE_SIZE = 32  # an 8x8 grid of 4-pixel patches, pixel-shuffled 2x2 to 16 rows
SMOLVLM_IMAGE_SEQ_LEN = 16


def smolvlm_config():
    from transformers import SmolVLMConfig

    return SmolVLMConfig(
        text_config=dict(
            model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=272,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, rms_norm_eps=1e-5),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=SMOLVLM_TILE_SIZE, patch_size=4),
        scale_factor=2, image_token_id=SMOLVLM_IMAGE_ID, tie_word_embeddings=False)


def make_tiny_smolvlm(path: str | os.PathLike) -> str:
    """A tiny random SmolVLM (float32, seeded) in ``path``: Llama text 2 layers of 64,
    SigLIP 2 layers of 32 over 32 x 32 tiles, 16 rows per tile; an image's longest edge
    resized to 64 pixels, then split into up to 2 x 2 tiles beside its global view (a
    square image: 2 x 2 tiles and the global one, 80 rows; a wide one 1 x 2 and the
    global one, 48 rows)."""
    path = str(path)
    if "smolvlm" not in _BUILT:
        _BUILT["smolvlm"] = _build_smolvlm()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["smolvlm"]):
        shutil.copyfile(os.path.join(_BUILT["smolvlm"], name), os.path.join(path, name))
    return path


def _build_smolvlm() -> str:
    from transformers import PreTrainedTokenizerFast, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-smolvlm-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(5200)
    model = SmolVLMForConditionalGeneration(smolvlm_config()).to(torch.float32)
    randomize(model, model.model.text_model.norm)
    with torch.no_grad():  # SigLIP's LayerNorms near one too, so its layers count
        for name, param in model.model.vision_model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        # rows near the text embeddings' scale (not ten times it), so that greedy tokens
        # follow what an image shows and not only that there is one
        model.model.connector.modality_projection.proj.weight.mul_(0.3)
    model.save_pretrained(path)
    SmolVLMImageProcessorPil(
        size={"longest_edge": 2 * SMOLVLM_TILE_SIZE},
        max_image_size={"longest_edge": SMOLVLM_TILE_SIZE}).save_pretrained(path)
    make_tiny_tokenizer(path)
    # named as SmolVLM's tokenizer names them, for transformers' SmolVLMProcessor
    hf = PreTrainedTokenizerFast.from_pretrained(path, extra_special_tokens={
        "fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    hf.add_special_tokens({"additional_special_tokens": SMOLVLM_TOKENS})
    assert hf.convert_tokens_to_ids(SMOLVLM_TOKENS) == list(range(256, 256 + len(SMOLVLM_TOKENS)))
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, SMOLVLM_CHAT_TEMPLATE)
    return path


# PaddleOCR-VL: its image markers and placeholder (the published tokenizer's names)
PADDLEOCR_VL_TOKENS = ["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>",
                       "<|VIDEO_PLACEHOLDER|>"]
(PADDLEOCR_IMAGE_START_ID, PADDLEOCR_IMAGE_END_ID, PADDLEOCR_IMAGE_ID,
 PADDLEOCR_VIDEO_ID) = range(256, 260)
# the published template's shape ("User: <images>text\nAssistant: answer" and its end
# of turn), the tiny tokenizer's <|im_end|> for the published </s>
PADDLEOCR_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}"
    "{{ '<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' }}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}"
    "{{ '<|im_end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def paddleocr_vl_config():
    from transformers import PaddleOCRVLConfig

    return PaddleOCRVLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=264,
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            pad_token_id=0, use_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]}),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=70, patch_size=14, spatial_merge_size=2),
        image_token_id=PADDLEOCR_IMAGE_ID, video_token_id=PADDLEOCR_VIDEO_ID,
        vision_start_token_id=PADDLEOCR_IMAGE_START_ID,
        vision_end_token_id=PADDLEOCR_IMAGE_END_ID)


def make_tiny_paddleocr_vl(path: str | os.PathLike) -> str:
    """A tiny random PaddleOCR-VL (float32, seeded) in ``path``: text 2 layers of 64 (biases
    on every projection, M-RoPE on sections [2, 3, 3]), SigLIP 2 layers of 32 whose 5 x 5
    table of positions is resampled to each image's grid; images of 28 x 28 to 112 x 112
    pixels after resizing (1 to 16 rows each)."""
    path = str(path)
    if "paddleocr_vl" not in _BUILT:
        _BUILT["paddleocr_vl"] = _build_paddleocr_vl()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(_BUILT["paddleocr_vl"]):
        shutil.copyfile(os.path.join(_BUILT["paddleocr_vl"], name), os.path.join(path, name))
    return path


def _randomize_paddleocr_vl(model) -> None:
    """Wider weights than ``randomize`` (whose PaddleOCR-VL repeats one token whatever the
    image): text 0.15, vision and projector 0.3, norms about 1, the final norm times 4,
    so that the image and its positions move the greedy tokens. The image tokens'
    embedding rows (the LM head's, tied) are scaled down, so that greedy decoding never
    writes one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layer_norm1.weight", "layer_norm2.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif ".visual." in name or ".projector." in name:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.15)
        model.model.language_model.norm.weight.mul_(4.0)
        model.model.language_model.embed_tokens.weight[PADDLEOCR_IMAGE_START_ID:].mul_(0.05)


def _build_paddleocr_vl() -> str:
    from transformers import PaddleOCRVLForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import \
        PaddleOCRVLImageProcessorPil

    path = tempfile.mkdtemp(prefix="loom-tiny-paddleocr_vl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(6100)
    model = PaddleOCRVLForConditionalGeneration(paddleocr_vl_config()).to(torch.float32)
    _randomize_paddleocr_vl(model)
    model.save_pretrained(path)
    PaddleOCRVLImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112}).save_pretrained(path)
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": PADDLEOCR_VL_TOKENS})
    assert hf.convert_tokens_to_ids(PADDLEOCR_VL_TOKENS) == list(range(256, 260))
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, PADDLEOCR_VL_CHAT_TEMPLATE)
    return path


def load_tower(tower_class, config, weights, dtype: torch.dtype = torch.float32,
               tp_group=None, quantization: str | None = None):
    """A family's vision tower as the model loader makes it: built in ``dtype`` (on
    ``tp_group``'s rank, or alone; its blocks' linears holding ``quantization``'s form
    where given), every parameter loaded from ``weights``, then each module's
    after-loading hook. ``weights``: a dict or (name, tensor) pairs."""
    from loom.distributed.parallel_state import SINGLE

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if quantization is not None:
            tower = tower_class(config, tp_group or SINGLE, quantization)
        elif tp_group is None:
            tower = tower_class(config)
        else:
            tower = tower_class(config, tp_group)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        loaded = tower.load_weights(weights.items() if isinstance(weights, dict) else weights)
    from loom.model.layers.linear import LinearBase

    derived = LinearBase.derived_parameters  # a quantized weight's, made, not loaded
    assert loaded == {name for name in dict(tower.named_parameters())
                      if name.rsplit(".", 1)[-1] not in derived}
    for module in tower.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    return tower.eval()


def outputs_in_passes(monkeypatch, tower, inner, pixels, grid, pass_rows: list[int]):
    """A tower's rows over ``pixels`` and ``grid`` with ``PASS_ROWS`` as it is, then with
    each of ``pass_rows``, and the patch rows of each image in each call of ``inner`` (the
    module that runs one pass: ``[[rows of image 0, rows of image 1, ...], ...]``)."""
    import loom.model.vision as vision

    passes = []
    real = inner.forward
    monkeypatch.setattr(inner, "forward", lambda p, g: passes.append(
        [t * h * w for t, h, w in g]) or real(p, g))
    with torch.no_grad():
        expected = tower(pixels, grid)
        outputs = []
        for rows in pass_rows:
            monkeypatch.setattr(vision, "PASS_ROWS", rows)
            outputs.append(tower(pixels, grid))
    return expected, outputs, passes
