"""Qwen2.5-VL with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint, whatever the engine does around the images.

Each prompt's reference is transformers' ``generate`` on that prompt alone, given the
token ids loom's processor expanded (one ``<|image_pad|>`` per row of the image) and the
image processor's pixels, so the comparison covers the tower, the placeholder rows,
M-RoPE positions and their delta in decode. loom runs all prompts in one batch: one
image, two images of different sizes, an image early in a longer prompt, text only;
then with chunks that cut an image's span, with few enough KV blocks to preempt, with
prefix caching off, and over two tensor-parallel ranks. The prefix cache hits a repeated
image and misses another image of the same size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import make_tiny_qwen2_5_vl

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt text, images): 6, 16 and 4 image rows (56x84, 112x112, 56x56 pixels)
PROMPTS = [
    (f"hello {IMAGE} the fox", [image(56, 84, 1)]),
    (f"{IMAGE} and {IMAGE} compared", [image(112, 112, 2), image(56, 56, 3)]),
    (f"<|im_start|>user\n{IMAGE} what is it<|im_end|>\n<|im_start|>assistant\na dog"
     "<|im_end|>\n<|im_start|>user\nand the colour?<|im_end|>\n<|im_start|>assistant\n",
     [image(56, 84, 4)]),
    ("the quick brown fox jumps over the lazy dog", []),
]

CONFIGS = {
    "default": dict(),
    # chunks of 8 tokens: every image's span is cut, some more than once
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(num_gpu_blocks_override=16, block_size=8, max_model_len=128),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}


def as_request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens for a prompt's token ids and images."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)

    def greedy(token_ids: list[int], images: list, video: dict | None = None) -> list[int]:
        """``video``: the video's arrays as loom's processor made them (transformers'
        video processor needs torchvision), fed to transformers' model as they are."""
        input_ids = torch.tensor([token_ids])
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = dict(pixel_values=pixels["pixel_values"],
                          image_grid_thw=pixels["image_grid_thw"])
        if video:
            kwargs |= {name: torch.from_numpy(array) for name, array in video.items()}
        types = ((input_ids == model.config.image_token_id).int()
                 + 2 * (input_ids == model.config.video_token_id).int())
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=types, max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, **kwargs)
        return out[0, len(token_ids):].tolist()

    return greedy


def generate(llm: LLM, requests: list) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, reference, config_name):
    llm = LLM(checkpoint, dtype="float32", seed=0, **({"max_model_len": 256}
                                                      | CONFIGS[config_name]))
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    for output, (text, images) in zip(outputs, PROMPTS):
        got = list(output.outputs[0].token_ids)
        assert got == reference(list(output.prompt_token_ids), images), text
    if config_name == "preemption":
        assert llm.engine.engine_core.get_stats().num_preemptions > 0
    # the image's placeholder rows are in the prompt the engine reports
    assert list(outputs[0].prompt_token_ids).count(258) == 6
    assert list(outputs[1].prompt_token_ids).count(258) == 16 + 4


def test_prefix_cache_keys_blocks_by_the_image(checkpoint, reference):
    """The same image again hits the prefix cache (blocks past the image included) and
    gives the same tokens; another image of the same size has the same placeholder
    tokens but misses from its first block on, and gives transformers' tokens for it."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, block_size=4)
    text = "one two three " + IMAGE + " what is in the picture, tell me"
    first = generate(llm, [as_request(text, [image(56, 84, 10)])])[0]
    again = generate(llm, [as_request(text, [image(56, 84, 10)])])[0]
    other = generate(llm, [as_request(text, [image(56, 84, 11)])])[0]
    assert first.prompt_token_ids == other.prompt_token_ids  # same size: same tokens
    image_start = list(first.prompt_token_ids).index(258)
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 4
    assert other.num_cached_tokens <= image_start
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(other.outputs[0].token_ids) == reference(list(other.prompt_token_ids),
                                                        [image(56, 84, 11)])


def test_tensor_parallel(checkpoint, reference):
    """Two ranks shard the decoder and the vision tower alike."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, tensor_parallel_size=2)
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS[:2]])
    for output, (text, images) in zip(outputs, PROMPTS[:2]):
        assert list(output.outputs[0].token_ids) == reference(list(output.prompt_token_ids),
                                                              images), text


def test_bad_images_are_the_requests_errors(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="2 images in one prompt, but at most 1"):
        llm.generate({"prompt": f"{IMAGE}{IMAGE}",
                      "multi_modal_data": {"image": [image(56, 56, 0)] * 2}}, use_tqdm=False)
    with pytest.raises(ValueError, match="1 image placeholders but 0 images|0 image "
                                         "placeholders but 1 images"):
        llm.generate({"prompt": "no placeholder here",
                      "multi_modal_data": {"image": image(56, 56, 0)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="takes image and video only, not audio"):
        llm.generate({"prompt": IMAGE, "multi_modal_data": {"audio": [b"\0" * 16]}},
                     use_tqdm=False)
    # the engine serves on
    assert generate(llm, [as_request(*PROMPTS[0])])[0].outputs[0].token_ids


def test_video_as_sampled_frames(checkpoint, reference):
    """A video of 5 frames at 1 fps (three temporal patches, the last frame repeated),
    beside an image: its rows and its temporal positions spaced by tokens_per_second x
    seconds per patch give transformers' tokens; chunks cut its span."""
    from loom.multimodal.qwen_vl import QwenVLProcessor
    from loom.model.loader import load_hf_config

    frames = [image(56, 84, 20 + i) for i in range(5)]
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, max_num_batched_tokens=8)
    request = {"prompt": f"watch {video} then {IMAGE} what changed",
               "multi_modal_data": {"video": (frames, {"fps": 1.0}), "image": image(56, 56, 9)}}
    output = generate(llm, [request])[0]
    arrays, rows = QwenVLProcessor(checkpoint, load_hf_config(checkpoint)).process_video(
        (frames, {"fps": 1.0}))
    assert rows == 3 * 6 and list(arrays["video_grid_thw"][0]) == [3, 4, 6]
    assert list(output.prompt_token_ids).count(259) == rows
    assert list(output.outputs[0].token_ids) == reference(
        list(output.prompt_token_ids), [image(56, 56, 9)], arrays)
