"""ERNIE 4.5 VL's images and videos: the checkpoint's ``Ernie4_5_VLMoeImageProcessor``
(PIL), for a video's frames too.

The chat template writes ``Picture N:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>``
per image and ``Video N:<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>`` per video; as
transformers' ``Ernie4_5_VLMoeProcessor``, the placeholder becomes one token per row the
tower makes, between the start and end markers the template wrote: an image's rows are
its 14-pixel patch grid merged 2x2, a video's each pair of frames merged too.

A video is its sampled frames, taken as given (a list of images or a (T, H, W, 3) uint8
array, optionally with their metadata as ``(frames, metadata)``: ``{"fps": their rate}``,
2 by default, frame i at i / fps seconds; or vLLM's ``{"fps": the source's rate,
"frames_indices": [...], ...}``, frame i at frames_indices[i] / fps), laid out as
transformers' ``Ernie4_5_VLMoeVideoProcessor`` lays out the frames it sampled (that
processor needs torchvision, which does not import here):

- each frame gets its timestamp (``time: 00:00:01.50``, its time as above)
  drawn in its top-left corner in the checkpoint's font, where the video config says
  ``draw_on_frames`` (transformers' default: the model reads the time off the frames;
  the prompt holds no timestamp text);
- an odd count of frames repeats the last one;
- each frame is resized (``smart_resize`` within the video config's ``size``, which is
  not the images'), rescaled, normalized and cut into patches as an image of one frame
  (``temporal_patch_size`` 1 here: a frame's patches appear once), frame after frame, so
  ``video_grid_thw`` is (frames, rows, columns) and the tower pairs frames 0 and 1, 2
  and 3... in its resampler. Its own resizing interpolates through torchvision, this
  one through PIL, as images are.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from loom.multimodal.processor import (MultiModalInputError, MultiModalProcessor, VideoTiming,
                                      checkpoint_video_settings)

# Ernie4_5_VLMoeVideoProcessor's defaults (its module imports torchvision, so they are
# restated): what a checkpoint's video config leaves out
_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 299 * 28 * 28, "longest_edge": 1196 * 28 * 28},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True,
    "draw_on_frames": True, "font": "Roboto-Regular.ttf",
}
# the video config's keys that the image processor takes as they are
_FRAME_KEYS = ("size", "patch_size", "merge_size", "image_mean", "image_std", "do_resize",
               "resample", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")
_TIMESTAMP_SIZE = 0.1  # the font's size as a fraction of the frame's shorter side


def video_settings(model_path: str) -> dict[str, Any]:
    """The checkpoint's video processor settings over this family's defaults."""
    return checkpoint_video_settings(model_path, _VIDEO_DEFAULTS)


def timestamp_text(seconds: float) -> str:
    """transformers' ``_convert_timestamp``: 1.5 -> "time: 00:00:01.50"."""
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    return f"time: {int(hours):02d}:{int(minutes):02d}:{seconds:05.02f}"


class Ernie4_5_VLProcessor(MultiModalProcessor):
    """``<|IMAGE_PLACEHOLDER|>`` (the config's ``image_token_id``) and
    ``<|VIDEO_PLACEHOLDER|>`` (``video_token_id``) are the placeholders."""

    modalities = ("image", "video")

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import \
            Ernie4_5_VLMoeImageProcessorPil

        self.image_processor = Ernie4_5_VLMoeImageProcessorPil.from_pretrained(model_path)
        self.placeholder_token_id = hf_config.image_token_id
        self.video_placeholder_token_id = hf_config.video_token_id
        self.merge_size = self.image_processor.merge_size
        self.video = video_settings(model_path)
        if self.video["temporal_patch_size"] != 2:
            raise ValueError(f"the video config's temporal_patch_size is "
                             f"{self.video['temporal_patch_size']}; ERNIE 4.5 VL pairs frames "
                             "(2)")
        # a frame is an image of the video config's settings
        self.frame_processor = Ernie4_5_VLMoeImageProcessorPil(
            **{key: self.video[key] for key in _FRAME_KEYS}, temporal_patch_size=1)
        self._font_path = os.path.join(model_path, str(self.video["font"]))

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"]
        length = int(grid.prod()) // self.merge_size ** 2
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, length

    def process_video(self, video: Any) -> tuple[dict[str, Any], int]:
        frames, metadata = video if isinstance(video, tuple) else (video, {})
        frames = [self._as_image(frame) for frame in frames]
        if not frames:
            raise MultiModalInputError("a video is a non-empty list of frames (images or a "
                                       "(T, H, W, 3) array)")
        if len({frame.size for frame in frames}) != 1:
            raise MultiModalInputError("a video's frames must all be of one size")
        times = VideoTiming.of(metadata, len(frames)).frame_times
        if self.video["draw_on_frames"]:
            frames = [self._draw_timestamp(frame, seconds)
                      for frame, seconds in zip(frames, times)]
        frames += frames[-1:] * (len(frames) % 2)  # an even count: frames pair up
        per_frame = [self.frame_processor(images=[frame], return_tensors="np")
                     for frame in frames]
        _, grid_h, grid_w = per_frame[0]["image_grid_thw"][0]
        arrays = {"pixel_values_videos": np.concatenate([out["pixel_values"]
                                                         for out in per_frame]),
                  "video_grid_thw": np.array([[len(frames), grid_h, grid_w]], dtype=np.int64)}
        length = len(frames) * int(grid_h) * int(grid_w) // (2 * self.merge_size ** 2)
        return arrays, length

    @staticmethod
    def _as_image(frame: Any) -> Any:
        from PIL import Image

        if isinstance(frame, Image.Image):
            return frame.convert("RGB")
        return Image.fromarray(np.asarray(frame, dtype=np.uint8)).convert("RGB")

    def _draw_timestamp(self, frame: Any, seconds: float) -> Any:
        """``frame`` with its time written on it as transformers'
        ``_render_image_with_timestamp`` writes it: black with a white outline, at the
        top-left corner, a tenth of the shorter side high."""
        from PIL import ImageDraw, ImageFont

        if not os.path.isfile(self._font_path):
            raise MultiModalInputError(
                f"this checkpoint's video config draws each frame's timestamp "
                f"(draw_on_frames) in the font {self.video['font']!r}, which is not in "
                f"{self.model_path}; put the font file there")
        frame = frame.copy()
        font_size = int(min(frame.size) * _TIMESTAMP_SIZE)
        font = ImageFont.truetype(self._font_path, font_size)
        ImageDraw.Draw(frame).text((0, 0), timestamp_text(seconds), font=font,
                                   fill=(0, 0, 0),
                                   stroke_width=int(font_size * _TIMESTAMP_SIZE),
                                   stroke_fill=(255, 255, 255))
        return frame
