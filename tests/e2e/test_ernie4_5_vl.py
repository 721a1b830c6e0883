"""ERNIE 4.5 VL with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint, and so do their logprobs, to 1e-4.

Each prompt's reference is transformers' ``generate`` on that prompt alone, given the
token ids loom's processor expanded (one ``<|IMAGE_PLACEHOLDER|>`` per row of the image),
the image processor's pixels, and the processor's two token-type masks (the image's
placeholders for the 3D positions; its placeholders and start/end markers for the
vision experts). That covers the tower, the placeholder rows, the 3D rope and its delta
in decode, and the routing of each token to the text or the vision experts. loom runs
all prompts in one batch: one image, two images of different sizes, an image in a
chat-formatted prompt, text only; then in chunks of 8 tokens, which cut the 16-row
image's span (and most others) and leave markers in steps apart from their image; with
few enough KV blocks to preempt; over two tensor-parallel ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import (ERNIE_IMAGE_END_ID, ERNIE_IMAGE_ID, ERNIE_IMAGE_START_ID,
                             make_tiny_ernie4_5_vl)

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 6
IMAGE = "Picture 1:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
IMAGE_2 = "Picture 2:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt text, images): 6, 16 and 4 image rows (56x84, 112x112, 56x56 pixels)
PROMPTS = [
    (f"hello {IMAGE} the fox", [image(56, 84, 1)]),
    (f"{IMAGE} and {IMAGE_2} compared", [image(112, 112, 2), image(56, 56, 3)]),
    (f"<|im_start|>user\n{IMAGE}what is it<|im_end|>\n<|im_start|>assistant\na dog"
     "<|im_end|>\n<|im_start|>user\nand the colour?<|im_end|>\n<|im_start|>assistant\n",
     [image(56, 84, 4)]),
    ("the quick brown fox jumps over the lazy dog", []),
]

CONFIGS = {
    "default": dict(),
    # chunks of 8 tokens: the 16-row image's span is cut twice at least
    "chunked_prefill": dict(max_num_batched_tokens=8),
    # few enough KV blocks that a request is preempted and its prompt, images and
    # generated tokens recomputed
    "preemption": dict(num_gpu_blocks_override=16, block_size=8, max_model_len=128),
}


def as_request(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_ernie4_5_vl(tmp_path_factory.mktemp("ernie4_5_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens and their logprobs for a prompt's token ids and
    images."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import \
        Ernie4_5_VLMoeImageProcessorPil

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    processor = Ernie4_5_VLMoeImageProcessorPil.from_pretrained(checkpoint)
    vision_ids = torch.tensor([ERNIE_IMAGE_START_ID, ERNIE_IMAGE_END_ID, ERNIE_IMAGE_ID])

    answers: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def greedy(token_ids: list[int], images: list) -> tuple[list[int], list[float]]:
        if tuple(token_ids) not in answers:  # the configs' prompts are the same
            answers[tuple(token_ids)] = generate(token_ids, images)
        return answers[tuple(token_ids)]

    def generate(token_ids: list[int], images: list) -> tuple[list[int], list[float]]:
        input_ids = torch.tensor([token_ids])
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = dict(pixel_values=pixels["pixel_values"],
                          image_grid_thw=pixels["image_grid_thw"])
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=(input_ids == ERNIE_IMAGE_ID).int(),
                moe_mm_token_type_ids=torch.isin(input_ids, vision_ids).int(),
                max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_scores=True,
                return_dict_in_generate=True, **kwargs)
        tokens = out.sequences[0, len(token_ids):].tolist()
        logprobs = [scores[0].log_softmax(-1)[token].item()
                    for scores, token in zip(out.scores, tokens)]
        return tokens, logprobs

    return greedy


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, reference, config_name):
    llm = LLM(checkpoint, dtype="float32", seed=0, **({"max_model_len": 256}
                                                      | CONFIGS[config_name]))
    outputs = check_against(llm, reference, PROMPTS)
    if config_name == "preemption":
        assert llm.engine.engine_core.get_stats().num_preemptions > 0
    # each image's placeholder rows are in the prompt the engine reports
    assert list(outputs[0].prompt_token_ids).count(ERNIE_IMAGE_ID) == 6
    assert list(outputs[1].prompt_token_ids).count(ERNIE_IMAGE_ID) == 16 + 4


def test_tensor_parallel(checkpoint, reference):
    """Two ranks split the attention heads, every expert's intermediate size (text,
    vision and shared) and the vision tower."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, tensor_parallel_size=2)
    check_against(llm, reference, PROMPTS[:2])


def check_against(llm: LLM, reference, prompts: list) -> list:
    """loom's greedy tokens and logprobs for ``prompts``, in one batch, against
    transformers' for each alone."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                            logprobs=0)
    outputs = llm.generate([as_request(text, images) for text, images in prompts], params,
                           use_tqdm=False)
    for output, (text, images) in zip(outputs, prompts):
        completion = output.outputs[0]
        tokens, logprobs = reference(list(output.prompt_token_ids), images)
        assert list(completion.token_ids) == tokens, text
        got = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(got, logprobs, atol=1e-4, err_msg=text)
    return outputs
