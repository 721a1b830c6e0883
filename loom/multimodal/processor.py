"""A prompt's images into its placeholder tokens and the features the workers embed.

Each multimodal family's chat template writes one placeholder per image (Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``); the checkpoint's own ``transformers``
image processor (its PIL backend: this runs in the API process, without torch) turns
each image into pixel arrays, and says how many rows the vision tower will make of them.
``MultiModalProcessor.apply`` repeats each image's placeholder token that many times and
describes the span as a ``MultiModalFeature``: where it starts, how long it is, its
arrays, and a hash of them that keys the prefix cache and the workers' encoder cache.

The processors are assembled from the image processor, the tokenizer and the chat
template, not ``AutoProcessor``: the families' processors include a video processor
that needs torchvision, which does not import beside loom's torch.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from loom.core.wire import MultiModalFeature, TensorData

logger = logging.getLogger(__name__)


class MultiModalInputError(ValueError):
    """Images a prompt cannot take; ``param`` names the part at fault."""

    def __init__(self, message: str, param: str = "multi_modal_data") -> None:
        super().__init__(message)
        self.param = param


def content_hash(arrays: dict[str, Any], modality: str) -> str:
    """A stable hash of an item's processed arrays: equal pixels give equal hashes."""
    digest = hashlib.blake2b(modality.encode(), digest_size=16)
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}:{array.dtype.name}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


DEFAULT_VIDEO_FPS = 2.0  # the frames' rate where a video comes without metadata



def placeholders_in(token_ids: list[int], kinds: dict[int, str],
                    items: dict[str, list]) -> list[tuple[int, str]]:
    """(position, modality) of each placeholder token (``kinds``: token id -> modality)
    in ``token_ids``; a MultiModalInputError unless each modality has one per item."""
    found = [(i, kinds[token]) for i, token in enumerate(token_ids) if token in kinds]
    for modality, given in items.items():
        count = sum(kind == modality for _, kind in found)
        if count != len(given):
            raise MultiModalInputError(
                f"the prompt has {count} {modality} placeholders but {len(given)} "
                f"{modality}s were given; write one placeholder per {modality} (the chat "
                f"template does this for {modality} parts)")
    return found


def checkpoint_video_settings(model_path: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's video processor settings over ``defaults``: the
    ``video_processor`` of processor_config.json, else video_preprocessor_config.json
    (transformers' order)."""
    settings: dict[str, Any] = {}
    nested = os.path.join(model_path, "processor_config.json")
    if os.path.isfile(nested):
        with open(nested) as f:
            settings = json.load(f).get("video_processor") or {}
    single = os.path.join(model_path, "video_preprocessor_config.json")
    if not settings and os.path.isfile(single):
        with open(single) as f:
            settings = json.load(f)
    return defaults | settings

@dataclass(frozen=True)
class VideoTiming:
    """When a video's sampled frames were, read from the metadata given with them as
    ``(frames, metadata)``, in either of two shapes:

    - ``{"fps": the frames' own rate}`` (or none: 2 fps): frame i at i / fps seconds;
    - vLLM's and transformers' ``{"fps": the source's rate, "frames_indices": [each
      frame's index in the file], "total_num_frames": ..., "duration": ...}`` (what
      media.load_video returns): frame i at frames_indices[i] / fps seconds.
    """

    num_frames: int
    fps: float
    frames_indices: tuple[float, ...] | None = None
    total_num_frames: int | None = None

    @classmethod
    def of(cls, metadata: dict[str, Any] | None, num_frames: int) -> VideoTiming:
        metadata = metadata or {}
        if not isinstance(metadata, dict):
            raise MultiModalInputError("a video's metadata is a dict, such as {\"fps\": 2.0}, "
                                       f"not {type(metadata).__name__}")
        fps = metadata.get("fps")
        fps = DEFAULT_VIDEO_FPS if fps is None else float(fps)
        if not fps > 0:
            raise MultiModalInputError(f"a video's fps must be positive, not {fps:g}")
        indices = metadata.get("frames_indices")
        if indices is not None:
            if len(indices) != num_frames:
                raise MultiModalInputError(f"the video's metadata names {len(indices)} "
                                           f"frames_indices for {num_frames} frames")
            indices = tuple(float(index) for index in indices)
        total = metadata.get("total_num_frames")
        return cls(num_frames, fps, indices, None if total is None else int(total))

    @property
    def frame_times(self) -> list[float]:
        """Each frame's seconds (transformers' ``VideoMetadata.timestamps``)."""
        indices = self.frames_indices or range(self.num_frames)
        return [index / self.fps for index in indices]

    @property
    def sampled_fps(self) -> float:
        """The sampled frames' rate, as transformers' ``VideoMetadata.sampled_fps``: the
        source's rate times the share of its frames sampled, where the metadata names
        both; else ``fps``."""
        if self.frames_indices is None or not self.total_num_frames:
            return self.fps
        return len(self.frames_indices) / self.total_num_frames * self.fps


class MultiModalProcessor:
    """What one family does with images (and videos, where it takes them). Subclasses
    set ``placeholder_token_id`` and ``process_image`` (``video_placeholder_token_id``
    and ``process_video`` for video)."""

    modalities: tuple[str, ...] = ("image",)

    def __init__(self, model_path: str, hf_config: Any) -> None:
        self.model_path = model_path
        self.hf_config = hf_config

    placeholder_token_id: int
    video_placeholder_token_id: int | None = None

    def process_image(self, image: Any) -> tuple[dict[str, Any], int]:
        """(the image processor's numpy arrays for this image alone, its rows)."""
        raise NotImplementedError

    def process_video(self, video: Any) -> tuple[dict[str, Any], int]:
        """(the arrays for this video alone, its rows): a video is its sampled frames."""
        raise NotImplementedError

    def apply(self, token_ids: list[int], images: list[Any], videos: list[Any] = ()
              ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with each item's placeholder token repeated once per row its
        tower makes, and the items' features, in prompt order. The prompt must hold one
        placeholder per image and per video."""
        placeholders = {self.placeholder_token_id: "image"}
        if self.video_placeholder_token_id is not None:
            placeholders[self.video_placeholder_token_id] = "video"
        items = {"image": list(images), "video": list(videos)}
        found = placeholders_in(token_ids, placeholders, items)
        process = {"image": self.process_image, "video": self.process_video}
        taken = {"image": iter(items["image"]), "video": iter(items["video"])}
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for at, modality in found:
            arrays, length = process[modality](next(taken[modality]))
            length = int(length)  # (a processor may count in numpy integers)
            out += token_ids[previous:at]
            features.append(MultiModalFeature(
                modality=modality, identifier=content_hash(arrays, modality),
                offset=len(out), length=length,
                data={name: TensorData.from_array(array) for name, array in arrays.items()}))
            out += [token_ids[at]] * length
            previous = at + 1
        out += token_ids[previous:]
        return out, features


# architecture -> (module under loom.multimodal, its processor class), imported lazily
_PROCESSORS: dict[str, tuple[str, str]] = {
    "Qwen2_5_VLForConditionalGeneration": ("qwen_vl", "QwenVLProcessor"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3Processor"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLProcessor"),
    "Ernie4_5_VLMoeForConditionalGeneration": ("ernie4_5_vl", "Ernie4_5_VLProcessor"),
    "PaddleOCRVLForConditionalGeneration": ("paddleocr_vl", "PaddleOCRVLProcessor"),
    "SmolVLMForConditionalGeneration": ("smolvlm", "SmolVLMProcessor"),
}


def is_multimodal(architecture: str | None) -> bool:
    return architecture in _PROCESSORS


def processor_for(model_path: str, architecture: str, hf_config: Any) -> MultiModalProcessor:
    module_name, class_name = _PROCESSORS[architecture]
    module = importlib.import_module(f"loom.multimodal.{module_name}")
    return getattr(module, class_name)(model_path, hf_config)
