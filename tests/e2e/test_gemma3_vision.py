"""Gemma 3 with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint, whatever the engine does around the images.

Each prompt's reference is transformers' own pipeline on the prompt's text and images:
its ``Gemma3Processor`` (which expands ``<start_of_image>`` and marks the soft tokens in
``token_type_ids``) and ``generate``, whose mask lets an image's tokens see each other
both ways (on the sliding layers only within the window: the checkpoint's window of 8 is
shorter than an image's 16 tokens). loom must expand each prompt to the same ids and
generate the same tokens: in one batch of mixed lengths (one image, two images of
different sizes, a chat-template prompt, text only), through ``LLM.chat``, with a step
budget that would otherwise end chunks inside images, and from the prefix cache, whose
hit may end inside an image (the rest of it runs in one step, seeing the cached part as
earlier keys). An image longer than a step's budget is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import IMAGE_SOFT_ID, make_tiny_gemma3_vl

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 8
IMAGE = "<start_of_image>"
TOKENS_PER_IMAGE = 16


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


CHAT = ("<start_of_turn>user\n" + IMAGE + "what is it<end_of_turn>\n<start_of_turn>model\n"
        "a dog<end_of_turn>\n<start_of_turn>user\nand the colour?<end_of_turn>\n"
        "<start_of_turn>model\n")
# (prompt text, (height, width, seed) of its images), of 10 to 80 tokens
PROMPTS = [
    (f"hello {IMAGE} the fox", [(56, 84, 1)]),
    (f"{IMAGE}\n{IMAGE} compared", [(150, 112, 2), (40, 60, 3)]),
    (CHAT, [(90, 70, 4)]),
    ("the quick brown fox jumps over the lazy dog", []),
]


def as_request(text: str, images: list) -> dict | str:
    if not images:
        return text
    return {"prompt": text, "multi_modal_data": {"image": [image(*i) for i in images]}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' (prompt ids, greedy tokens) for a prompt's text and images;
    ``bidirectional=False`` leaves out token_type_ids, so images attend causally."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import \
        Gemma3ImageProcessorPil

    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint,
                                                           dtype=torch.float32).eval()
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(
        checkpoint), tokenizer=AutoTokenizer.from_pretrained(checkpoint),
        image_seq_length=TOKENS_PER_IMAGE)
    done = {}

    def greedy(text: str, images: list, bidirectional: bool = True
               ) -> tuple[list[int], list[int]]:
        key = (text, tuple(images), bidirectional)
        if key not in done:
            pil = [image(*i) for i in images]
            inputs = processor(text=[text], images=[pil] if pil else None,
                               return_tensors="pt")
            if not bidirectional:
                inputs.pop("token_type_ids")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            prompt_ids = inputs["input_ids"][0].tolist()
            done[key] = prompt_ids, out[0, len(prompt_ids):].tolist()
        return done[key]

    return greedy


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=256, seed=0)


def generate(llm: LLM, requests: list) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


def assert_matches(outputs, prompts, reference) -> None:
    for output, (text, images) in zip(outputs, prompts):
        prompt_ids, tokens = reference(text, images)
        assert list(output.prompt_token_ids) == prompt_ids, text
        assert list(output.outputs[0].token_ids) == tokens, text


def test_the_reference_tells_bidirectional_from_causal(reference):
    """With causal attention among an image's tokens transformers generates other
    tokens: the comparisons below would catch a mask that left the images causal."""
    assert any(reference(text, images)[1] != reference(text, images, bidirectional=False)[1]
               for text, images in PROMPTS if images)


def test_greedy_matches_transformers(llm, reference):
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    assert_matches(outputs, PROMPTS, reference)
    ids = list(outputs[1].prompt_token_ids)
    assert ids.count(IMAGE_SOFT_ID) == 2 * TOKENS_PER_IMAGE


def test_chat_puts_the_image_where_its_part_is(llm, reference):
    """LLM.chat's image part: the chat template writes <start_of_image> in its place,
    and the prompt is the chat prompt above."""
    messages = [
        {"role": "user", "content": [{"type": "image_pil", "image_pil": image(90, 70, 4)},
                                     {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": "a dog"},
        {"role": "user", "content": "and the colour?"}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert_matches(llm.chat(messages, params, use_tqdm=False), [PROMPTS[2]], reference)


def test_chunks_never_end_inside_an_image(checkpoint, reference):
    """A budget of 20 tokens a step: a chunk that would end inside an image stops before
    it, and the next runs the image whole (the runner raises on a step that cuts one)."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0,
              max_num_batched_tokens=20)
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    assert_matches(outputs, PROMPTS, reference)
    # the first prompt's image fills tokens 8..23: a 20-token chunk would end inside it
    first = list(outputs[0].prompt_token_ids).index(IMAGE_SOFT_ID)
    assert first < 20 < first + TOKENS_PER_IMAGE


def test_prefix_cache_keys_blocks_by_the_image(llm, reference):
    """The same image again hits the prefix cache and gives the same tokens; another
    image of the same size has the same prompt ids but misses from the image's first
    block on, and gives transformers' tokens for it."""
    text = "one two three " + IMAGE + " what is in the picture, tell me"
    first, again, other = (generate(llm, [as_request(text, [i])])[0]
                           for i in ((60, 80, 10), (60, 80, 10), (60, 80, 11)))
    assert first.prompt_token_ids == other.prompt_token_ids
    image_start = list(first.prompt_token_ids).index(IMAGE_SOFT_ID)
    assert again.num_cached_tokens >= image_start + TOKENS_PER_IMAGE
    assert other.num_cached_tokens <= image_start
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_matches([first, other], [(text, [(60, 80, 10)]), (text, [(60, 80, 11)])],
                   reference)


def test_prefix_hit_ending_inside_an_image(llm, reference):
    """A prompt that ends just after its image: the hit of its repeat (whole blocks of
    16, but for the last token) ends inside the image, and the step that runs the rest
    lets it see the whole image."""
    text = "hi " + IMAGE
    request = (text, [(70, 50, 20)])
    first = generate(llm, [as_request(*request)])[0]
    again = generate(llm, [as_request(*request)])[0]
    image_start = list(first.prompt_token_ids).index(IMAGE_SOFT_ID)
    assert image_start < again.num_cached_tokens < image_start + TOKENS_PER_IMAGE
    assert_matches([first, again], [request, request], reference)


def test_an_image_longer_than_a_step_is_refused(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="fills 16 tokens, which attend to each other.*"
                                         "max_num_batched_tokens is 12"):
        generate(llm, [as_request(*PROMPTS[0])])
    # the engine serves on
    assert generate(llm, [PROMPTS[3][0]])[0].outputs[0].token_ids
