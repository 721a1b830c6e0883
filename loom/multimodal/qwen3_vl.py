"""Qwen3-VL's images and videos: images through Qwen2.5-VL's processor
(``QwenVLProcessor``, the checkpoint's ``Qwen2VLImageProcessor`` settings: patch 16,
mean and std 0.5); videos as transformers' ``Qwen3VLVideoProcessor`` and
``Qwen3VLProcessor`` lay them out.

A video is its sampled frames, taken as given (a list of images or a (T, H, W, 3) uint8
array, optionally with ``{"fps": ...}`` as ``(frames, metadata)``: frame i was at
i / fps seconds, 2 fps by default; or vLLM's and transformers'
``{"fps": the video's rate, "frames_indices": [...]}``, what media.load_video returns:
frame i was at frames_indices[i] / fps seconds). Its pixels:

- every frame resized to one size, ``smart_resize`` over the whole video (the frames
  count against the video config's ``size``, which is not the images'), through PIL
  (transformers interpolates through torchvision, which does not import here; a frame
  already of that size is not resized by either);
- rescaled and normalized as the video processor fuses them: (x - mean / rescale) /
  (std / rescale), in float32;
- an odd count of frames repeats the last; each pair of frames (``temporal_patch_size``)
  is one temporal patch, cut into 16-pixel patches in merge-block order.

Its prompt: the chat template writes ``<|vision_start|><|video_pad|><|vision_end|>``;
as transformers' processor, that becomes, per temporal patch, its timestamp (the mean
of its two frames' times, ``<1.5 seconds>``) and its own span:

    <0.5 seconds><|vision_start|><|video_pad|> x rows<|vision_end|><2.5 seconds><|vision_start|>...

The first timestamp's text joins the text before it, as it does in transformers'
prompt string, so the tokens from the last special token up to it are tokenized again
with it (``"video:<0.5 seconds>"`` may tokenize otherwise than its halves).

Each temporal patch is its own feature (modality "video", grid (1, h, w)): its tokens'
M-RoPE positions are an image's of that grid (transformers' ``get_rope_index`` splits a
video's grid so), and the tower attends within a frame pair, so a patch's rows through
the tower alone equal its rows in the whole video's pass.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import numpy as np

from loom.core.wire import MultiModalFeature, TensorData
from loom.multimodal.processor import (MultiModalInputError, VideoTiming,
                                      checkpoint_video_settings, content_hash,
                                      placeholders_in)
from loom.multimodal.qwen_vl import QwenVLProcessor

# Qwen3VLVideoProcessor's defaults (its module imports torch, so they are restated):
# what a checkpoint's video config leaves out
_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True,
    "cap_pixels_per_frame": None, "max_video_tokens": 768,
}


def video_settings(model_path: str) -> dict[str, Any]:
    """The checkpoint's video processor settings over this family's defaults."""
    return checkpoint_video_settings(model_path, _VIDEO_DEFAULTS)


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                 min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """A video's frame size, as transformers' ``video_processing_qwen3_vl.smart_resize``:
    multiples of ``factor``, the frames' pixels together within [min, max]."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MultiModalInputError(f"a video's frames are {width}x{height}; Qwen3-VL takes "
                                   "an aspect ratio of at most 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamps(frame_times: list[float], temporal_patch_size: int) -> list[float]:
    """Each temporal patch's time, as ``Qwen3VLProcessor._calculate_timestamps``: the
    last frame repeated to fill the last patch, each patch the mean of its first and
    last frames' times."""
    times = list(frame_times)
    times += times[-1:] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(times), temporal_patch_size)]


class Qwen3VLProcessor(QwenVLProcessor):
    """``<|image_pad|>`` once per row of an image (the 16-pixel patch grid merged 2x2);
    a video's ``<|video_pad|>`` placeholder becomes its timestamped temporal patches."""

    def __init__(self, model_path: str, hf_config: Any) -> None:
        super().__init__(model_path, hf_config)
        if self.video_placeholder_token_id is not None:
            self.vision_start_token_id = hf_config.vision_start_token_id
            self.vision_end_token_id = hf_config.vision_end_token_id
            self.video = video_settings(model_path)

    @cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (the timestamps are text), loaded at the first video."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    @cached_property
    def _boundary_token_ids(self) -> frozenset[int]:
        """The added tokens: text is split at them before it is tokenized."""
        return frozenset(self.tokenizer.added_tokens_decoder)

    # ---- a video's pixels --------------------------------------------------------

    def process_video(self, video: Any) -> tuple[dict[str, Any], int]:
        """(``pixel_values_videos`` (patches, C * 2 * P * P) and ``video_grid_thw``
        [[t, h, w]] of the whole video, as transformers' video processor makes them,
        and ``timestamps`` (t,): each temporal patch's seconds; its rows)."""
        frames, metadata = video if isinstance(video, tuple) else (video, {})
        pixels = self._frames_array(frames)  # (T, H, W, 3) uint8
        settings = self.video
        pair, patch, merge = (settings["temporal_patch_size"], settings["patch_size"],
                              settings["merge_size"])
        if len(pixels) < pair:
            raise MultiModalInputError(f"a Qwen3-VL video needs at least {pair} frames (a "
                                       f"temporal patch), got {len(pixels)}")
        frame_times = VideoTiming.of(metadata, len(pixels)).frame_times
        if settings["do_resize"]:
            pixels = self._resized(pixels, settings)
        values = self._rescaled_and_normalized(pixels, settings)  # (T, C, H, W)
        values = np.concatenate([values, values[-1:].repeat(-len(values) % pair, axis=0)])
        frames_count, channels, height, width = values.shape
        grid_t, grid_h, grid_w = frames_count // pair, height // patch, width // patch
        # Qwen3VLVideoProcessor.patchify: (t, pair, C, h/m, m, P, w/m, m, P) ->
        # (t, h/m, w/m, m, m, C, pair, P, P), one row per patch in merge-block order
        patches = values.reshape(grid_t, pair, channels, grid_h // merge, merge, patch,
                                 grid_w // merge, merge, patch)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(
            grid_t * grid_h * grid_w, channels * pair * patch * patch)
        arrays = {"pixel_values_videos": np.ascontiguousarray(patches),
                  "video_grid_thw": np.array([[grid_t, grid_h, grid_w]], dtype=np.int64),
                  "timestamps": np.array(timestamps(frame_times, pair))}
        return arrays, grid_t * grid_h * grid_w // merge ** 2

    @staticmethod
    def _frames_array(frames: Any) -> np.ndarray:
        from PIL import Image

        if isinstance(frames, np.ndarray):
            frames = list(frames)
        images = [frame.convert("RGB") if isinstance(frame, Image.Image)
                  else Image.fromarray(np.asarray(frame, dtype=np.uint8)).convert("RGB")
                  for frame in frames or ()]
        if not images:
            raise MultiModalInputError("a video is a non-empty list of frames (images or a "
                                       "(T, H, W, 3) array)")
        if len({image.size for image in images}) != 1:
            raise MultiModalInputError("a video's frames must all be of one size")
        return np.stack([np.asarray(image) for image in images])

    @staticmethod
    def _resized(pixels: np.ndarray, settings: dict[str, Any]) -> np.ndarray:
        """The frames at the video's ``smart_resize`` size (``Qwen3VLVideoProcessor.resize``,
        its per-frame pixel cap included where the config asks for it)."""
        from PIL import Image

        num_frames, height, width = pixels.shape[:3]
        factor = settings["patch_size"] * settings["merge_size"]
        size = settings["size"]
        max_pixels = size["longest_edge"]
        if settings["cap_pixels_per_frame"]:
            frame_cap = settings["max_video_tokens"] * factor * factor
            per_frame = max(min(frame_cap, size["longest_edge"] // num_frames),
                            int(size["shortest_edge"] * 1.05))
            max_pixels = per_frame * num_frames
        new_height, new_width = smart_resize(num_frames, height, width,
                                             settings["temporal_patch_size"], factor,
                                             size["shortest_edge"], max_pixels)
        if (new_height, new_width) == (height, width):
            return pixels
        resample = Image.Resampling(settings["resample"])
        return np.stack([np.asarray(Image.fromarray(frame).resize((new_width, new_height),
                                                                  resample=resample))
                         for frame in pixels])

    @staticmethod
    def _rescaled_and_normalized(pixels: np.ndarray, settings: dict[str, Any]) -> np.ndarray:
        """(T, C, H, W) float32, as the video processor's fused rescale and normalize:
        mean and std divided by the rescale factor in float32, then (x - mean) / std."""
        values = pixels.astype(np.float32)
        if settings["do_normalize"]:
            scale = np.float32(1.0 / settings["rescale_factor"]) if settings["do_rescale"] \
                else np.float32(1.0)
            mean = np.asarray(settings["image_mean"], np.float32) * scale
            std = np.asarray(settings["image_std"], np.float32) * scale
            values = (values - mean) / std
        elif settings["do_rescale"]:
            values = values * np.float32(settings["rescale_factor"])
        return values.transpose(0, 3, 1, 2)

    # ---- the prompt ---------------------------------------------------------------

    def apply(self, token_ids: list[int], images: list[Any], videos: list[Any] = ()
              ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with each image's placeholder repeated once per row, each
        video's placeholder (and the ``<|vision_start|>``/``<|vision_end|>`` around it,
        where the template wrote them) replaced by its timestamped temporal patches;
        the features in prompt order, a video's one per temporal patch."""
        if self.video_placeholder_token_id is None:
            if videos:
                raise MultiModalInputError("this checkpoint names no video_token_id; it "
                                           "takes images only")
            return super().apply(token_ids, images)
        kinds = {self.placeholder_token_id: "image", self.video_placeholder_token_id: "video"}
        items = {"image": list(images), "video": list(videos)}
        found = placeholders_in(token_ids, kinds, items)
        taken = {modality: iter(given) for modality, given in items.items()}
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for at, modality in found:
            out += token_ids[previous:at]
            previous = at + 1
            if modality == "image":
                arrays, length = self.process_image(next(taken["image"]))
                features.append(_feature("image", arrays, len(out), int(length)))
                out += [token_ids[at]] * int(length)
                continue
            if (out[-1:] == [self.vision_start_token_id]
                    and token_ids[at + 1:at + 2] == [self.vision_end_token_id]):
                out.pop()  # the template's wrapper: each temporal patch has its own
                previous = at + 2
            features += self._expand_video(out, next(taken["video"]))
        out += token_ids[previous:]
        return out, features

    def _expand_video(self, out: list[int], video: Any) -> list[MultiModalFeature]:
        """Append ``video``'s timestamped temporal patches to ``out``; their features."""
        arrays, _ = self.process_video(video)
        grid_t, grid_h, grid_w = (int(v) for v in arrays["video_grid_thw"][0])
        rows_per_patch = grid_h * grid_w // self.merge_size ** 2
        patches = arrays["pixel_values_videos"].reshape(grid_t, grid_h * grid_w, -1)
        features = []
        for index, seconds in enumerate(arrays["timestamps"]):
            stamp = f"<{seconds:.1f} seconds>"
            if index == 0:  # its text joins the text before it, back to an added token
                start = len(out)
                while start > 0 and out[start - 1] not in self._boundary_token_ids:
                    start -= 1
                text = self.tokenizer.decode(out[start:], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
                out[start:] = self.tokenizer.encode(text + stamp, add_special_tokens=False)
            else:
                out += self.tokenizer.encode(stamp, add_special_tokens=False)
            out.append(self.vision_start_token_id)
            patch_arrays = {"pixel_values_videos": patches[index],
                            "video_grid_thw": np.array([[1, grid_h, grid_w]], dtype=np.int64)}
            features.append(_feature("video", patch_arrays, len(out), rows_per_patch))
            out += [self.video_placeholder_token_id] * rows_per_patch
            out.append(self.vision_end_token_id)
        return features


def _feature(modality: str, arrays: dict[str, Any], offset: int, length: int
             ) -> MultiModalFeature:
    return MultiModalFeature(
        modality=modality, identifier=content_hash(arrays, modality), offset=offset,
        length=length, data={name: TensorData.from_array(array)
                             for name, array in arrays.items()})
