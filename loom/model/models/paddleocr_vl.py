"""PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``): an ERNIE 4.5 0.3B-style
language model that reads images, with M-RoPE.

The checkpoint is four parts: the vision tower (``visual.vision_model.``) and its
projector (``mlp_AR.``), both in loom/model/vision/paddleocr_vl.py; the decoder
(``model.``) and the LM head (tied to the embeddings by default). transformers 5 names
them ``model.visual.``, ``model.projector.`` and ``model.language_model.`` in memory;
either form loads.

The decoder is Llama with ``use_bias`` on every projection, as ERNIE 4.5, but its rope
rotates halves (``rotate_half``, as transformers runs the published weights), not
ERNIE 4.5's interleaved pairs: no reordering at load. The rope is Qwen2-VL's M-RoPE:
``mrope_section`` (default [16, 24, 24]) splits the frequencies into three runs turned
by the temporal, height and width positions.

A prompt holds ``<|IMAGE_START|>``, one ``<|IMAGE_PLACEHOLDER|>`` per row the tower
makes of the image (its 14-pixel patch grid merged 2x2), then ``<|IMAGE_END|>``
(loom/multimodal/paddleocr_vl.py expands the placeholder); those rows take the place
of the placeholders' embeddings. Positions are transformers' ``get_rope_index``, the
same rule as Qwen2.5-VL's for images (``qwen_vl_mrope_positions``): text counts up, an
image starting at position s takes (s, s + row, s + column) in its merged grid, and
the text after it resumes at s + max(rows, columns).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from loom.core.wire import MultiModalFeature
from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.layers.rotary import rope_parameters
from loom.model.models.llama import DecoderLayerSpec, LlamaForCausalLM
from loom.model.models.qwen2_5_vl import qwen_vl_mrope_positions
from loom.model.vision import tower_weights_on_the_way

_DEFAULT_MROPE_SECTION = [16, 24, 24]  # transformers' where the config names none
# checkpoint prefix -> the tower's own (published names, then transformers 5's)
_TOWER_PREFIXES = {"visual.": "", "model.visual.": "", "mlp_AR.": "projector.",
                   "model.projector.": "projector."}


def _with_mrope(config: Any) -> Any:
    """``config`` whose rope parameters name the M-RoPE sections (the checkpoint's, else
    transformers' default), so that ``get_rope`` builds the multimodal rope."""
    params = rope_parameters(config)
    if params.get("mrope_section"):
        return config
    config = copy.copy(config)
    params["mrope_section"] = list(_DEFAULT_MROPE_SECTION)
    config.rope_parameters = params
    return config


class PaddleOCRVLForConditionalGeneration(LlamaForCausalLM):
    """The decoder with the vision tower beside it. The model runner asks it for an
    image's rows (``embed_multimodal``), for a prompt's positions (``mrope_positions``),
    and runs its forward with ``mm_embeds`` where the step holds image tokens."""

    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        bias = bool(getattr(config, "use_bias", False))
        return DecoderLayerSpec.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.paddleocr_vl import PaddleOCRVisionTower

        super().__init__(_with_mrope(config), tp_group, attention_backend,
                         weight_quantization, expert_parallel)
        self.visual = PaddleOCRVisionTower(config, tp_group, weight_quantization)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of an image's placeholder tokens: (length, hidden_size)."""
        return self.embed_multimodal_batch([feature])[0]

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Images through the tower in one pass (their patches side by side, each
        attending within itself), each image's rows."""
        for feature in features:
            if feature.modality != "image":
                raise ValueError(f"{type(self).__name__} takes images, not "
                                 f"{feature.modality}")
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.cat([torch.from_numpy(f.data["pixel_values"].to_array())
                            for f in features]).to(dtype)
        grid = torch.cat([torch.from_numpy(f.data["image_grid_thw"].to_array()).reshape(-1, 3)
                          for f in features])
        return list(self.visual(pixels, grid).split([f.length for f in features]))

    def mrope_positions(self, num_tokens: int, features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray, int]:
        return qwen_vl_mrope_positions(num_tokens, features, self.spatial_merge_size)

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
        def route(name: str) -> tuple[bool, str]:
            prefix = next((p for p in _TOWER_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                return True, _TOWER_PREFIXES[prefix] + name[len(prefix):]
            return False, name.replace("model.language_model.", "model.", 1)

        tower: set[str] = set()
        loaded = super().load_weights(tower_weights_on_the_way(weights, route, self.visual,
                                                               tower))
        return loaded | {f"visual.{name}" for name in tower}
