"""PaddleOCR-VL's images: the checkpoint's ``PaddleOCRVLImageProcessor`` (PIL).

The chat template writes ``<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>`` per image;
as transformers' ``PaddleOCRVLProcessor``, the placeholder becomes one token per row the
tower makes (the image's 14-pixel patch grid merged 2x2), between the markers the
template wrote.
"""

from __future__ import annotations

from typing import Any

from loom.multimodal.processor import MultiModalProcessor


class PaddleOCRVLProcessor(MultiModalProcessor):
    """``<|IMAGE_PLACEHOLDER|>`` (the config's ``image_token_id``) is the placeholder."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
            PaddleOCRVLImageProcessorPil,
        )

        self.image_processor = PaddleOCRVLImageProcessorPil.from_pretrained(model_path)
        self.placeholder_token_id = hf_config.image_token_id
        self.merge_size = self.image_processor.merge_size

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"]
        length = int(grid.prod()) // self.merge_size ** 2
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, length
