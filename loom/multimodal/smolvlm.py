"""SmolVLM's images: the checkpoint's ``SmolVLMImageProcessor`` (PIL), which resizes an
image's longest edge to ``size``, splits it into tiles of ``max_image_size`` (where
``do_image_splitting``) and adds a global view of it, one tile resized.

The chat template writes ``<image>`` where an image goes. As Hugging Face's
``SmolVLMProcessor`` does (its ``get_image_prompt_string``), each becomes the image's
tiles row by row, then its global view, each tile ``image_seq_len`` ``<image>`` tokens:

    <fake_token_around_image><row_1_col_1><image>...<fake_token_around_image><row_1_col_2>...\\n
    <fake_token_around_image><row_2_col_1><image>...                                       ...\\n
    \\n<fake_token_around_image><global-img><image>...<fake_token_around_image>

(an image too small to split: only the global view's line). The expansion begins and
ends with ``<fake_token_around_image>``, a special token, so it tokenizes alone as it
does inside the prompt's text.

The image's feature spans from its first ``<image>`` token to its last, the markers
between tiles included, and carries the span's token ids (``span_token_ids``): the
model puts the tower's rows at the ``<image>`` tokens and the markers' own embeddings at
theirs (loom/model/models/smolvlm.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loom.core.wire import MultiModalFeature, TensorData
from loom.multimodal.processor import MultiModalInputError, MultiModalProcessor, content_hash


class SmolVLMProcessor(MultiModalProcessor):
    """SmolVLM: an image is its tiles and its global view, each ``image_seq_len`` rows;
    ``<image>`` is the placeholder the prompt holds."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        from transformers import AutoTokenizer
        from transformers.models.smolvlm.image_processing_pil_smolvlm import \
            SmolVLMImageProcessorPil

        self.image_processor = SmolVLMImageProcessorPil.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # the tokenizer's names for them, as SmolVLMProcessor reads them
        self.fake_image_token = getattr(self.tokenizer, "fake_image_token",
                                        "<fake_token_around_image>")
        self.image_token = getattr(self.tokenizer, "image_token", "<image>")
        self.global_image_token = getattr(self.tokenizer, "global_image_token", "<global-img>")
        self.placeholder_token_id = hf_config.image_token_id
        if self.tokenizer.convert_tokens_to_ids(self.image_token) != self.placeholder_token_id:
            raise ValueError(f"the tokenizer's {self.image_token} is not the config's "
                             f"image_token_id {self.placeholder_token_id}")
        vision = hf_config.vision_config
        self.image_seq_len = (vision.image_size // vision.patch_size) ** 2 \
            // hf_config.scale_factor ** 2

    def tiles(self, image: Any) -> tuple[dict[str, Any], int, int]:
        """(the image's arrays: its tiles' ``pixel_values`` (N, 3, S, S) and, only where
        some pixel is padding, their ``pixel_attention_mask`` (N, S, S); its rows and
        columns of tiles, 0 and 0 where it is not split)."""
        out = self.image_processor(images=[[image]], return_row_col_info=True,
                                   return_tensors="np")
        arrays = {"pixel_values": np.asarray(out["pixel_values"][0], dtype=np.float32)}
        mask = np.asarray(out["pixel_attention_mask"][0])
        if not mask.all():
            arrays["pixel_attention_mask"] = mask.astype(bool)
        return arrays, int(np.asarray(out["rows"]).reshape(-1)[0]), \
            int(np.asarray(out["cols"]).reshape(-1)[0])

    def expansion(self, rows: int, cols: int) -> list[int]:
        """The token ids an image of ``rows`` x ``cols`` tiles writes in the prompt."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        text = get_image_prompt_string(rows, cols, self.image_seq_len,
                                       fake_token_around_image=self.fake_image_token,
                                       image_token=self.image_token,
                                       global_image_token=self.global_image_token)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def apply(self, token_ids: list[int], images: list[Any], videos: list[Any] = ()
              ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with each ``<image>`` expanded into the image's tiles, and the
        images' features (each its first to last ``<image>`` token), in prompt order."""
        if videos:
            raise MultiModalInputError("SmolVLM takes images only, not videos")
        found = [i for i, token in enumerate(token_ids) if token == self.placeholder_token_id]
        if len(found) != len(images):
            raise MultiModalInputError(
                f"the prompt has {len(found)} image placeholders ({self.image_token}) but "
                f"{len(images)} images were given; write one per image (the chat template "
                "does this for image parts)")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for at, image in zip(found, images):
            arrays, rows, cols = self.tiles(image)
            expanded = self.expansion(rows, cols)
            # | markers | <image> ... markers ... <image> | <fake_token_around_image> |
            image_at = [i for i, token in enumerate(expanded)
                        if token == self.placeholder_token_id]
            num_tiles = arrays["pixel_values"].shape[0]
            if len(image_at) != num_tiles * self.image_seq_len:
                raise ValueError(f"an image of {num_tiles} tiles expanded into "
                                 f"{len(image_at)} {self.image_token} tokens, not "
                                 f"{num_tiles} x {self.image_seq_len}; is the tokenizer "
                                 "SmolVLM's?")
            first, last = image_at[0], image_at[-1] + 1
            arrays["span_token_ids"] = np.asarray(expanded[first:last], dtype=np.int64)
            out += token_ids[previous:at]
            features.append(MultiModalFeature(
                modality="image", identifier=content_hash(arrays, "image"),
                offset=len(out) + first, length=last - first,
                data={name: TensorData.from_array(array) for name, array in arrays.items()}))
            out += expanded
            previous = at + 1
        out += token_ids[previous:]
        return out, features
