"""Gemma 3's images: the checkpoint's ``Gemma3ImageProcessor`` (PIL), no pan-and-scan.

The chat template writes ``<start_of_image>`` where an image goes. As Hugging Face's
``Gemma3Processor`` does, each becomes

    \\n\\n <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> \\n\\n

and the soft tokens are the span the tower's rows fill (``MultiModalFeature``, marked
``bidirectional``: Gemma 3's image tokens attend to each other both ways). Hugging Face
expands the prompt's text before tokenizing it, so the inserted newlines join the
newlines next to them into one run, which Gemma's tokenizer writes as one token ("\\n" +
"\\n\\n" is the token for three); working on token ids, ``apply`` re-encodes each run of
newline tokens around an image whole (as vLLM does).

A .gguf model with llama.cpp's projector (``--mmproj``) reads its tokenizer from the
text file (loom/tokenizer.py), and its image processor from a preprocessor_config.json
beside the file, or else from the projector's metadata (image size, mean, std; bilinear
resampling: loom/model/loader/gguf_mmproj.py).
"""

from __future__ import annotations

import os
from typing import Any

from loom.core.wire import MultiModalFeature, TensorData
from loom.multimodal.processor import MultiModalInputError, MultiModalProcessor, content_hash


def image_processor(model_path: str, hf_config: Any) -> Any:
    """The checkpoint's ``Gemma3ImageProcessorPil``: its preprocessor_config.json (for a
    .gguf model, the one beside the file); a .gguf model with a llama.cpp projector
    (``--mmproj``) and no such file beside it takes the projector's settings."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    directory = (model_path if os.path.isdir(model_path)
                 else os.path.dirname(os.path.abspath(model_path)))
    mmproj = getattr(hf_config, "mmproj", None)
    if mmproj is None or os.path.isfile(os.path.join(directory, "preprocessor_config.json")):
        return Gemma3ImageProcessorPil.from_pretrained(directory)
    from loom.model.loader.gguf_mmproj import image_processor_kwargs

    return Gemma3ImageProcessorPil(**image_processor_kwargs(mmproj))


def _tokenizer(model_path: str) -> Any:
    """The Hugging Face tokenizer of a checkpoint directory or of a .gguf file's
    vocabulary (converted once and cached, as the engine's own)."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        from loom.tokenizer import load_tokenizer

        return load_tokenizer(model_path).hf
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class Gemma3Processor(MultiModalProcessor):
    """Gemma 3: every image resized to the tower's square, ``mm_tokens_per_image`` rows;
    ``<start_of_image>`` is the placeholder the prompt holds."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        self.image_processor = image_processor(model_path, hf_config)
        self.tokenizer = _tokenizer(model_path)
        self.placeholder_token_id = hf_config.boi_token_id
        self.image_token_id = hf_config.image_token_id
        self.end_token_id = hf_config.eoi_token_id
        self.tokens_per_image = hf_config.mm_tokens_per_image

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        out = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="np")
        return {"pixel_values": out["pixel_values"]}, self.tokens_per_image

    def apply(self, token_ids: list[int], images: list[Any], videos: list[Any] = ()
              ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with each ``<start_of_image>`` expanded into the image's whole
        sequence, and the images' features (their soft tokens), in prompt order."""
        if videos:
            raise MultiModalInputError("Gemma 3 takes images only, not videos")
        found = [i for i, token in enumerate(token_ids) if token == self.placeholder_token_id]
        if len(found) != len(images):
            raise MultiModalInputError(
                f"the prompt has {len(found)} image placeholders (<start_of_image>) but "
                f"{len(images)} images were given; write one per image (the chat template "
                "does this for image parts)")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for at, image in zip(found, images):
            arrays, length = self.process_image(image)
            out += token_ids[previous:at]
            # | ... newlines before | \n\n <boi> | soft x length | <eoi> \n\n | newlines after ... |
            before = 0
            while out and self._newlines_in(out[-1]):
                before += self._newlines_in(out.pop())
            out += self._newline_run(before + 2) + [self.placeholder_token_id]
            features.append(MultiModalFeature(
                modality="image", identifier=content_hash(arrays, "image"), offset=len(out),
                length=length, bidirectional=True,
                data={name: TensorData.from_array(array) for name, array in arrays.items()}))
            out += [self.image_token_id] * length + [self.end_token_id]
            previous, after = at + 1, 0
            while previous < len(token_ids) and self._newlines_in(token_ids[previous]):
                after += self._newlines_in(token_ids[previous])
                previous += 1
            out += self._newline_run(after + 2)
        out += token_ids[previous:]
        return out, features

    def _newlines_in(self, token_id: int) -> int:
        """The newlines ``token_id`` stands for where it is nothing else, else 0."""
        text = self.tokenizer.decode([token_id])
        return len(text) if text and text == "\n" * len(text) else 0

    def _newline_run(self, count: int) -> list[int]:
        return self.tokenizer.encode("\n" * count, add_special_tokens=False)
