"""Qwen3-VL's images: Qwen2.5-VL's processor (``QwenVLProcessor``), with the
checkpoint's ``Qwen2VLImageProcessor`` settings (patch 16, mean and std 0.5).

Images only: Qwen3-VL writes a timestamp before each temporal patch of a video, each
patch its own ``<|vision_start|>`` ... ``<|vision_end|>`` span, which Qwen2.5-VL's
video layout does not.
"""

from __future__ import annotations

from typing import Any

from loom.multimodal.qwen_vl import QwenVLProcessor


class Qwen3VLProcessor(QwenVLProcessor):
    """``<|image_pad|>`` once per row: the 16-pixel patch grid merged 2x2."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        self.modalities = ("image",)
        self.video_placeholder_token_id = None
