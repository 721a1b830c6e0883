"""SmolVLM with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint.

Each prompt's reference is transformers' own pipeline on the prompt's text and images:
its ``SmolVLMProcessor`` (which expands each ``<image>`` into the image's tiles, their
row/column markers and its global view, then tokenizes the text) and ``generate``. The
processor is built without its video processor (which needs torchvision) and without
num2words (which only its video prompts use). loom must expand each prompt to the same
ids (its own image processor and expansion, token by token) and generate the same
tokens: one image split into 2 x 2 tiles, two images of other tilings (1 x 2 and 2 x 1),
a chat prompt through ``LLM.chat``, text only; in one batch, and in chunks of 24 tokens,
which end inside an image's span (between its tiles' markers and rows alike).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import SMOLVLM_IMAGE_ID, SMOLVLM_IMAGE_SEQ_LEN, make_tiny_smolvlm

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 8
CHUNK = 24


def image(height: int, width: int, seed: int) -> Image.Image:
    """A smooth picture (a random 3 x 3 colour grid, blown up): unlike noise, what two
    such pictures show differs enough to move the tiny model's tokens."""
    rng = np.random.default_rng(seed)
    colours = Image.fromarray(rng.integers(0, 256, (3, 3, 3), dtype=np.uint8))
    return colours.resize((width, height), Image.BILINEAR)


CHAT = "<|im_start|>User:<image>what is it<end_of_utterance>\nAssistant:"
# (prompt text, (height, width, seed) of its images): 2 x 2 tiles (80 rows); 1 x 2 and
# 2 x 1 tiles (48 rows each); 2 x 2 tiles in a chat
PROMPTS = [
    ("hello <image> the fox", [(64, 64, 1)]),
    ("<image>\n<image> compared", [(40, 90, 2), (90, 40, 3)]),
    (CHAT, [(50, 60, 4)]),
    ("the quick brown fox jumps over the lazy dog", []),
]


def as_request(text: str, images: list) -> dict | str:
    if not images:
        return text
    return {"prompt": text, "multi_modal_data": {"image": [image(*i) for i in images]}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm"))


def smolvlm_processor(checkpoint: str):
    """transformers' ``SmolVLMProcessor`` for images: no video processor, and num2words
    (which its video prompts spell frame counts with) stood in for while it checks."""
    from transformers import AutoTokenizer
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil

    class ImagesOnly(processing_smolvlm.SmolVLMProcessor):
        def __init__(self, image_processor, tokenizer, image_seq_len: int) -> None:
            super().__init__(image_processor, tokenizer, None, image_seq_len=image_seq_len)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processing_smolvlm, "num2words", str)
        return ImagesOnly(SmolVLMImageProcessorPil.from_pretrained(checkpoint),
                          AutoTokenizer.from_pretrained(checkpoint), SMOLVLM_IMAGE_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' (prompt ids, greedy tokens) for a prompt's text and images."""
    from transformers import SmolVLMForConditionalGeneration

    model = SmolVLMForConditionalGeneration.from_pretrained(checkpoint,
                                                            dtype=torch.float32).eval()
    processor = smolvlm_processor(checkpoint)
    done = {}

    def greedy(text: str, images: list) -> tuple[list[int], list[int]]:
        key = (text, tuple(images))
        if key not in done:
            pil = [image(*i) for i in images]
            inputs = processor(text=[text], images=[pil] if pil else None,
                               return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            prompt_ids = inputs["input_ids"][0].tolist()
            done[key] = prompt_ids, out[0, len(prompt_ids):].tolist()
        return done[key]

    return greedy


def generate(llm: LLM, requests: list) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


def assert_matches(outputs, prompts, reference) -> None:
    for output, (text, images) in zip(outputs, prompts):
        prompt_ids, tokens = reference(text, images)
        assert list(output.prompt_token_ids) == prompt_ids, text
        assert list(output.outputs[0].token_ids) == tokens, text


def test_the_reference_follows_the_image(reference):
    """Another picture in the same prompt moves transformers' tokens: the comparisons
    below would catch rows that went to the wrong tokens."""
    text = PROMPTS[0][0]
    assert reference(text, [(64, 64, 1)])[1] != reference(text, [(64, 64, 5)])[1]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunks_of_24"])
def test_greedy_matches_transformers(checkpoint, reference, chunked):
    budget = {"max_num_batched_tokens": CHUNK, "enable_chunked_prefill": True} if chunked else {}
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, seed=0, **budget)
    outputs = generate(llm, [as_request(text, images) for text, images in PROMPTS])
    assert_matches(outputs, PROMPTS, reference)
    ids = list(outputs[0].prompt_token_ids)
    image_at = [i for i, token in enumerate(ids) if token == SMOLVLM_IMAGE_ID]
    assert len(image_at) == 5 * SMOLVLM_IMAGE_SEQ_LEN  # 2 x 2 tiles and the global view
    # chunks of 24 end inside the first image's span, which runs from its first <image>
    # token to its last, markers between tiles included
    assert image_at[0] < CHUNK < 2 * CHUNK < image_at[-1]
    assert len(image_at) < image_at[-1] - image_at[0] + 1


def test_chat_puts_the_image_where_its_part_is(checkpoint, reference):
    """LLM.chat's image part: the chat template writes <image> in its place, and the
    prompt is the chat prompt above."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, seed=0)
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image(50, 60, 4)},
        {"type": "text", "text": "what is it"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert_matches(llm.chat(messages, params, use_tqdm=False), [PROMPTS[2]], reference)


def test_videos_are_refused(checkpoint):
    from loom.model.loader.hf_config import load_hf_config
    from loom.multimodal.processor import MultiModalInputError, processor_for

    processor = processor_for(checkpoint, "SmolVLMForConditionalGeneration",
                              load_hf_config(checkpoint))
    with pytest.raises(MultiModalInputError, match="images only"):
        processor.apply([SMOLVLM_IMAGE_ID], [], [[image(32, 32, 0)]])
