"""PaddleOCR-VL with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint.

Each prompt's reference is transformers' ``generate`` on that prompt alone, given the
token ids loom's processor expanded (one ``<|IMAGE_PLACEHOLDER|>`` per row of the image)
and the image processor's pixels: the comparison covers the tower (its resampled
position table, 2D rope, the projector's 2x2 merge), the placeholder rows, M-RoPE
positions and their delta in decode. loom runs all prompts in one batch (one image, two
images of different sizes, text only), whole and in chunks of 8 tokens, which cut the
16-row image's span.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import PADDLEOCR_IMAGE_ID, make_tiny_paddleocr_vl

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 6
IMAGE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt text, images): 6, then 16 and 7 image rows (56x84, 112x112, 28x196 pixels)
PROMPTS = [
    (f"User: {IMAGE}OCR:\nAssistant: ", [image(56, 84, 1)]),
    (f"{IMAGE} and {IMAGE} compared", [image(112, 112, 2), image(30, 200, 3)]),
    ("the quick brown fox jumps over the lazy dog", []),
]

CONFIGS = {
    "default": {},
    # a 16-row image in chunks of 8 tokens: its span is cut at least once
    "chunked_prefill": {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},
}


def as_request(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_paddleocr_vl(tmp_path_factory.mktemp("paddleocr_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens for a prompt's token ids and images."""
    from transformers import PaddleOCRVLForConditionalGeneration
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import \
        PaddleOCRVLImageProcessorPil

    model = PaddleOCRVLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # loom ignores EOS too
    processor = PaddleOCRVLImageProcessorPil.from_pretrained(checkpoint)

    def greedy(token_ids: list[int], images: list) -> list[int]:
        input_ids = torch.tensor([token_ids])
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = {"pixel_values": pixels["pixel_values"],
                      "image_grid_thw": pixels["image_grid_thw"]}
        with torch.no_grad():
            out = model.generate(input_ids=input_ids,
                                 attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=(input_ids == PADDLEOCR_IMAGE_ID).int(),
                                 max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
        return out[0, len(token_ids):].tolist()

    return greedy


def generate(llm: LLM, requests: list) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, reference, config_name):
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, **CONFIGS[config_name])
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    for output, (text, images) in zip(outputs, PROMPTS):
        got = list(output.outputs[0].token_ids)
        assert got == reference(list(output.prompt_token_ids), images), text
    assert list(outputs[0].prompt_token_ids).count(PADDLEOCR_IMAGE_ID) == 6
    assert list(outputs[1].prompt_token_ids).count(PADDLEOCR_IMAGE_ID) == 16 + 7
    if config_name == "default":
        # the image moves the greedy tokens: the comparisons above hold loom's tower
        # and positions to transformers'
        other = generate(llm, [as_request(PROMPTS[0][0], [image(56, 84, 9)])])[0]
        assert other.prompt_token_ids == outputs[0].prompt_token_ids
        assert other.outputs[0].token_ids != outputs[0].outputs[0].token_ids
