"""Qwen2-VL and Qwen2.5-VL's images: the checkpoint's ``Qwen2VLImageProcessor`` (PIL)."""

from __future__ import annotations

from typing import Any

from loom.multimodal.processor import MultiModalProcessor


class QwenVLProcessor(MultiModalProcessor):
    """Qwen2.5-VL (and Qwen2-VL): patches of ``patch_size`` pixels, 2x2 of them merged
    into one row; ``<|image_pad|>`` is the placeholder."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
            Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.placeholder_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"]
        length = int(grid.prod()) // self.merge_size ** 2
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, length
