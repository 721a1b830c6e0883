"""Gemma 3's processor (loom/multimodal/gemma3.py) expands a prompt's ``<start_of_image>``
tokens into the ids transformers' ``Gemma3Processor`` makes of the prompt's text, with a
tokenizer that, as Gemma's, has one token for each run of newlines: the newlines it adds
around an image join those beside it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from tokenizer_fixtures import make_tiny_tokenizer
from vlm_checkpoints import BOI_ID, EOI_ID, GEMMA3_TOKENS, IMAGE_SOFT_ID

from loom.multimodal.gemma3 import Gemma3Processor

TOKENS_PER_IMAGE = 4
NEWLINE_RUNS = ["\n\n", "\n\n\n", "\n\n\n\n"]  # ids 261..263; one newline is byte 188


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import \
        Gemma3ImageProcessorPil

    path = str(tmp_path_factory.mktemp("gemma3_processor"))
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>"})
    hf.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    hf.add_tokens(NEWLINE_RUNS)
    hf.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(path)
    return path


@pytest.mark.parametrize("text", [
    "hello <start_of_image> the fox",
    "a\n<start_of_image>\n\nb",  # 1 + 2 newlines before the image, 2 + 2 after
    "<start_of_image><start_of_image>",  # 2 + 2 between two images
    "x\n\n\n<start_of_image>\ny<start_of_image>",
])
def test_expansion_matches_transformers(checkpoint, text):
    from transformers import AutoTokenizer, Gemma3Processor as HFGemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = SimpleNamespace(boi_token_id=BOI_ID, image_token_id=IMAGE_SOFT_ID,
                             eoi_token_id=EOI_ID, mm_tokens_per_image=TOKENS_PER_IMAGE)
    processor = Gemma3Processor(checkpoint, config)
    images = [Image.fromarray(np.full((30 + 10 * i, 40, 3), 60 * i, np.uint8))
              for i in range(text.count("<start_of_image>"))]
    token_ids, features = processor.apply(tokenizer.encode(text), images)

    hf = HFGemma3Processor(image_processor=processor.image_processor, tokenizer=tokenizer,
                           image_seq_length=TOKENS_PER_IMAGE)
    expected = hf(text=[text], images=[images], return_tensors="np")
    assert token_ids == expected["input_ids"][0].tolist()
    soft = np.flatnonzero(expected["token_type_ids"][0])
    assert [(f.offset, f.length, f.bidirectional) for f in features] == [
        (int(start), TOKENS_PER_IMAGE, True) for start in soft[::TOKENS_PER_IMAGE]]
    pixels = np.concatenate([f.data["pixel_values"].to_array() for f in features])
    np.testing.assert_array_equal(pixels, expected["pixel_values"])
