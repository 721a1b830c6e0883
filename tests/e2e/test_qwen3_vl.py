"""Qwen3-VL with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint.

Each prompt's reference is transformers' ``generate`` on that prompt alone, given the
token ids loom's processor expanded (one ``<|image_pad|>`` per row of the image) and the
image processor's pixels: the comparison covers the tower, the placeholder rows, the
deepstack rows added after the first decoder layers, interleaved M-RoPE positions and
their delta in decode. loom runs all prompts in one batch (one image, two images of
different sizes, text only), whole and in chunks of 8 tokens, which cut the 16-row
image's span: each chunk adds the deepstack rows of its own image tokens.

Videos: a video alone and one beside an image, in one batch, whole and in chunks of 8
(which cut the videos' spans, timestamps and all). transformers gets the prompt ids
loom wrote (a timestamp and a span per pair of frames) and the whole video's pixels
as loom's processor made them (transformers' video processor needs torchvision;
tests/multimodal/test_qwen3_vl_processor.py holds both to it): its tower runs the video
in one pass where loom runs each pair of frames as its own item, and its
``get_rope_index`` splits the video's grid where loom's features are already split.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import IMAGE_PAD_ID, VIDEO_PAD_ID, make_tiny_qwen3_vl

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
CHUNK = 8


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt text, images): 6, then 16 and 2 image rows (64x96, 128x128, 32x64 pixels)
PROMPTS = [
    (f"hello {IMAGE} the fox", [image(64, 96, 1)]),
    (f"{IMAGE} and {IMAGE} compared", [image(128, 128, 2), image(32, 64, 3)]),
    ("the quick brown fox jumps over the lazy dog", []),
]

CONFIGS = {
    "default": dict(),
    # a 16-row image in chunks of 8 tokens: its span is cut at least once
    "chunked_prefill": dict(max_num_batched_tokens=CHUNK, enable_chunked_prefill=True),
}


def as_request(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # loom ignores EOS too
    return model


@contextlib.contextmanager
def without_deepstack(model):
    """``model`` with its deepstack mergers' outputs zero: nothing added after layers."""
    outs = [merger.linear_fc2 for merger in model.model.visual.deepstack_merger_list]
    saved = [(out.weight.clone(), out.bias.clone()) for out in outs]
    with torch.no_grad():
        for out in outs:
            out.weight.zero_()
            out.bias.zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            for out, (weight, bias) in zip(outs, saved):
                out.weight.copy_(weight)
                out.bias.copy_(bias)


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    """transformers' greedy tokens for a prompt's token ids and images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)

    def greedy(token_ids: list[int], images: list, video: dict | None = None) -> list[int]:
        """``video``: the whole video's arrays as loom's processor made them."""
        input_ids = torch.tensor([token_ids])
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = dict(pixel_values=pixels["pixel_values"],
                          image_grid_thw=pixels["image_grid_thw"])
        if video:
            kwargs |= {name: torch.from_numpy(video[name])
                       for name in ("pixel_values_videos", "video_grid_thw")}
        types = (input_ids == IMAGE_PAD_ID).int() + 2 * (input_ids == VIDEO_PAD_ID).int()
        with torch.no_grad():
            out = hf_model.generate(input_ids=input_ids,
                                    attention_mask=torch.ones_like(input_ids),
                                    mm_token_type_ids=types,
                                    max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
        return out[0, len(token_ids):].tolist()

    return greedy


def generate(llm: LLM, requests: list) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, reference, hf_model, config_name):
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, **CONFIGS[config_name])
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    for output, (text, images) in zip(outputs, PROMPTS):
        got = list(output.outputs[0].token_ids)
        assert got == reference(list(output.prompt_token_ids), images), text
    assert list(outputs[0].prompt_token_ids).count(IMAGE_PAD_ID) == 6
    assert list(outputs[1].prompt_token_ids).count(IMAGE_PAD_ID) == 16 + 2
    if config_name == "default":
        # the deepstack rows change the greedy tokens: the comparisons above hold
        # loom's deepstack to transformers'
        with without_deepstack(hf_model):
            for output, (text, images) in zip(outputs[:2], PROMPTS[:2]):
                plain = reference(list(output.prompt_token_ids), images)
                assert list(output.outputs[0].token_ids) != plain, text


def frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


# (prompt text, images, video (frames, metadata)): 5 frames of 64 x 96 at 1 fps (3 pairs,
# the last frame repeated, of 6 rows each); 6 frames of 64 x 64 beside a 4-row image
VIDEO_PROMPTS = [
    (f"watch {VIDEO} what happens", [], (frames(5, 64, 96, seed=11), {"fps": 1.0})),
    (f"{IMAGE} and{VIDEO} compared", [image(64, 64, 12)],
     (frames(6, 64, 64, seed=13), {"fps": 2.0})),
]


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_video_matches_transformers(checkpoint, reference, hf_model, config_name):
    from loom.model.loader import load_hf_config
    from loom.multimodal.qwen3_vl import Qwen3VLProcessor

    processor = Qwen3VLProcessor(checkpoint, load_hf_config(checkpoint))
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, **CONFIGS[config_name])
    outputs = generate(llm, [{"prompt": text, "multi_modal_data": (
        {"video": video} | ({"image": images} if images else {}))}
        for text, images, video in VIDEO_PROMPTS])
    for output, (text, images, video) in zip(outputs, VIDEO_PROMPTS):
        arrays, rows = processor.process_video(video)
        prompt_ids = list(output.prompt_token_ids)
        assert prompt_ids.count(VIDEO_PAD_ID) == rows
        assert prompt_ids.count(257) == 3 + len(images)  # <|vision_end|>: one a pair
        assert list(output.outputs[0].token_ids) == reference(prompt_ids, images, arrays), text
    assert [processor.process_video(v)[1] for _, _, v in VIDEO_PROMPTS] == [3 * 6, 3 * 4]
    if config_name == "default":
        # the video tokens' deepstack rows change the greedy tokens: the comparison
        # above holds loom's deepstack for video tokens to transformers'
        with without_deepstack(hf_model):
            text, images, video = VIDEO_PROMPTS[0]
            plain = reference(list(outputs[0].prompt_token_ids), images,
                              processor.process_video(video)[0])
            assert list(outputs[0].outputs[0].token_ids) != plain
