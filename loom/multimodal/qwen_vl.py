"""Qwen2-VL and Qwen2.5-VL's images and videos: the checkpoint's
``Qwen2VLImageProcessor`` (PIL).

A video is its sampled frames (a list of images or a (T, H, W, 3) array, optionally with
their metadata as ``(frames, metadata)``: ``{"fps": their rate}``, 2 by default, or
vLLM's ``{"fps", "frames_indices", "total_num_frames", ...}``, whose frames' rate is the
source's times the share of its frames sampled, as transformers'
``VideoMetadata.sampled_fps``; ``second_per_grid_ts`` is ``temporal_patch_size`` over
that rate, as transformers' ``Qwen2_5_VLProcessor`` makes it). Each frame is resized and
normalized by the image processor, as one image; consecutive pairs of frames
(``temporal_patch_size``) make one temporal patch, the last frame repeated to fill a
pair, as transformers' ``Qwen2VLVideoProcessor`` lays them out (that processor itself
needs torchvision, which does not import here; its own resizing interpolates through
torchvision, this one through PIL, as images are).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from loom.multimodal.processor import MultiModalInputError, MultiModalProcessor, VideoTiming


def image_processor(model_path: str, hf_config: Any) -> Any:
    """The checkpoint's ``Qwen2VLImageProcessorPil``: its preprocessor_config.json (for
    a .gguf model, the one beside the file); a .gguf model with a llama.cpp projector
    (``--mmproj``) and no such file beside it takes the projector's settings
    (loom/model/loader/gguf_mmproj.py)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    directory = (model_path if os.path.isdir(model_path)
                 else os.path.dirname(os.path.abspath(model_path)))
    mmproj = getattr(hf_config, "mmproj", None)
    if mmproj is None or os.path.isfile(os.path.join(directory, "preprocessor_config.json")):
        return Qwen2VLImageProcessorPil.from_pretrained(directory)
    from loom.model.loader.gguf_mmproj import image_processor_kwargs

    return Qwen2VLImageProcessorPil(**image_processor_kwargs(mmproj))


class QwenVLProcessor(MultiModalProcessor):
    """Qwen2.5-VL (and Qwen2-VL): patches of ``patch_size`` pixels, 2x2 of them merged
    into one row; ``<|image_pad|>`` is the placeholder."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        self.image_processor = image_processor(model_path, hf_config)
        self.placeholder_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        if getattr(hf_config, "video_token_id", None) is not None:
            self.modalities = ("image", "video")
            self.video_placeholder_token_id = hf_config.video_token_id

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"]
        length = int(grid.prod()) // self.merge_size ** 2
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, length

    def process_video(self, video: Any) -> tuple[dict[str, Any], int]:
        frames, metadata = video if isinstance(video, tuple) else (video, {})
        frames = list(frames)
        if not frames:
            raise MultiModalInputError("a video is a non-empty list of frames (images or a "
                                       "(T, H, W, 3) array)")
        fps = VideoTiming.of(metadata, len(frames)).sampled_fps
        per_frame = [self.image_processor(images=[frame], return_tensors="np")
                     for frame in frames]
        grids = {tuple(out["image_grid_thw"][0]) for out in per_frame}
        if len(grids) != 1:
            raise MultiModalInputError("a video's frames must all be of one size")
        _, grid_h, grid_w = grids.pop()
        pair = self.image_processor.temporal_patch_size
        patch = self.image_processor.patch_size
        rows = grid_h * grid_w
        # each frame's patches hold it `pair` times over: keep one copy, (rows, C, P, P)
        singles = [out["pixel_values"].reshape(rows, -1, pair, patch, patch)[:, :, 0]
                   for out in per_frame]
        singles += [singles[-1]] * (-len(singles) % pair)
        groups = [np.stack(singles[g:g + pair], axis=2).reshape(rows, -1)
                  for g in range(0, len(singles), pair)]
        grid = np.array([[len(groups), grid_h, grid_w]], dtype=np.int64)
        arrays = {"pixel_values_videos": np.concatenate(groups),
                  "video_grid_thw": grid,
                  "second_per_grid_ts": np.array([pair / fps], dtype=np.float32)}
        return arrays, len(groups) * rows // self.merge_size ** 2
