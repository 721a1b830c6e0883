"""Qwen2.5-VL: a Qwen2 language model that reads images, with M-RoPE.

The checkpoint's ``Qwen2_5_VLForConditionalGeneration`` is three parts, each loaded
from its own prefix: the vision tower (``visual.``, loom/model/vision/qwen2_5_vl.py),
the Qwen2 decoder (``model.``) and the LM head (``lm_head.``).

A prompt holds ``<|vision_start|>``, then one ``<|image_pad|>`` per row the tower makes
of the image (its patch grid merged 2x2), then ``<|vision_end|>``
(loom/multimodal/qwen_vl.py expands them); a video, ``<|video_pad|>`` per row of its
frames, two frames to a temporal patch. Those rows take the place of the pad tokens'
embeddings. Positions are M-RoPE's (``mrope_positions``): text counts up as usual, an
image's tokens share one temporal position and take their row and column in the
merged grid as height and width positions, and the text after an image resumes past
its larger side.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from loom.core.wire import MultiModalFeature
from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.models.qwen2 import Qwen2ForCausalLM
from loom.model.vision import tower_weights_on_the_way

_DEFAULT_MROPE_SECTION = [16, 24, 24]  # Hugging Face's default where the config names none
# a feature's arrays by modality: (pixels, grid)
_ARRAYS = {"image": ("pixel_values", "image_grid_thw"),
           "video": ("pixel_values_videos", "video_grid_thw")}


def _with_mrope(config: Any) -> Any:
    """``config`` whose rope parameters name the M-RoPE sections (the checkpoint's, else
    Hugging Face's default), so that ``get_rope`` builds the multimodal rope."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
                  or {})
    if params.get("mrope_section"):
        return config
    config = copy.copy(config)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 1000000.0))
    params["rope_type"] = "default" if params.get("rope_type", params.get("type")) in (
        None, "mrope", "default") else params.get("rope_type", params.get("type"))
    params["mrope_section"] = list(_DEFAULT_MROPE_SECTION)
    config.rope_parameters = params
    return config


def qwen_vl_weight_route(name: str) -> tuple[bool, str]:
    """A Qwen-VL checkpoint tensor's (to the tower?, its name there): published checkpoints
    name the tower "visual." and the decoder "model."; transformers 5 (and Qwen3-VL's
    checkpoints) "model.visual." and "model.language_model."."""
    if name.startswith(("visual.", "model.visual.")):
        return True, name.split("visual.", 1)[1]
    return False, name.replace("model.language_model.", "model.", 1)


def qwen_vl_mrope_positions(num_tokens: int, features: list[MultiModalFeature],
                            spatial_merge_size: int, tokens_per_second: float = 2
                            ) -> tuple[np.ndarray, int]:
    """(3, ``num_tokens``) M-RoPE positions of a prompt whose images and videos are
    ``features``, and the delta that continues them (position ``i`` past the prompt is
    ``i + delta`` on all three axes), as ``Qwen2_5_VLModel.get_rope_index``: text counts
    up from where the last item left off; an item of merged grid (t, h, w) starting at
    position p takes (p + t_i * interval, p + h_i, p + w_i), and the text after it
    resumes at p + max(h, w). An image's interval is 1; a video's is
    ``tokens_per_second`` times its seconds per temporal patch (float32, truncated, as
    transformers computes it; 1 where the feature names none, transformers' default)."""
    positions = np.empty((3, num_tokens), np.int64)
    current = previous_end = 0
    for feature in sorted(features, key=lambda f: f.offset):
        text = feature.offset - previous_end
        positions[:, previous_end:feature.offset] = np.arange(text) + current
        current += text
        grid_name = _ARRAYS[feature.modality][1]
        t, h, w = (int(v) for v in feature.data[grid_name].to_array().reshape(-1))
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != feature.length:
            raise ValueError(f"an item of grid {t}x{h}x{w} fills {t * h * w} placeholder "
                             f"tokens, not {feature.length}")
        temporal = np.arange(t)
        if feature.modality == "video":
            seconds = (feature.data["second_per_grid_ts"].to_array().reshape(-1)[0]
                       if "second_per_grid_ts" in feature.data else 1.0)
            interval = np.float32(tokens_per_second) * np.float32(seconds)
            temporal = (temporal.astype(np.float32) * interval).astype(np.int64)
        grid_t, grid_h, grid_w = np.meshgrid(temporal, np.arange(h), np.arange(w),
                                             indexing="ij")
        for axis, grid in enumerate((grid_t, grid_h, grid_w)):
            positions[axis, feature.offset:feature.end] = grid.reshape(-1) + current
        current += max(h, w)
        previous_end = feature.end
    positions[:, previous_end:] = np.arange(num_tokens - previous_end) + current
    return positions, int(positions.max()) + 1 - num_tokens


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2 with the vision tower beside it. The model runner asks it for an image's
    rows (``embed_multimodal``), for a prompt's positions (``mrope_positions``), and
    runs its forward with ``mm_embeds`` where the step holds image tokens."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.qwen2_5_vl import Qwen2_5_VLVisionTower

        super().__init__(_with_mrope(config), tp_group, attention_backend,
                         weight_quantization, expert_parallel)
        self.visual = Qwen2_5_VLVisionTower(config, tp_group, weight_quantization)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.tokens_per_second = getattr(config.vision_config, "tokens_per_second", 2)

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of ``feature``'s placeholder tokens (an image's, or a video's: its
        frames in pairs through the same tower): (length, hidden_size)."""
        if feature.modality not in _ARRAYS:
            raise ValueError(f"{type(self).__name__} takes images and videos, not "
                             f"{feature.modality}")
        pixels_name, grid_name = _ARRAYS[feature.modality]
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.from_numpy(feature.data[pixels_name].to_array()).to(dtype)
        grid = torch.from_numpy(feature.data[grid_name].to_array()).reshape(-1, 3)
        return self.visual(pixels, grid)

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Items of one modality through the tower in one pass (their patches side by
        side, each attending within itself), each item's rows."""
        pixels_name, grid_name = _ARRAYS[features[0].modality]
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.cat([torch.from_numpy(f.data[pixels_name].to_array())
                            for f in features]).to(dtype)
        grid = torch.cat([torch.from_numpy(f.data[grid_name].to_array()).reshape(-1, 3)
                          for f in features])
        return list(self.visual(pixels, grid).split([f.length for f in features]))

    def mrope_positions(self, num_tokens: int, features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray, int]:
        return qwen_vl_mrope_positions(num_tokens, features, self.spatial_merge_size,
                                       self.tokens_per_second)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mm_embeds``: (indices in the step, rows) of image tokens, whose rows take
        the place of their embeddings; ``positions`` (3, T) where the step has them."""
        if mm_embeds is None:
            return self.model(input_ids, positions)
        index, rows = mm_embeds
        inputs_embeds = self.model.embed(input_ids)
        inputs_embeds[index] = rows.to(inputs_embeds.dtype)
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tower: set[str] = set()
        loaded = super().load_weights(tower_weights_on_the_way(weights, qwen_vl_weight_route,
                                                               self.visual, tower))
        return loaded | {f"visual.{name}" for name in tower}
