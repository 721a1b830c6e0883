"""SmolVLM: a Llama language model that reads images, cut into tiles.

The checkpoint's ``SmolVLMForConditionalGeneration`` is three parts: the SigLIP tower
and its connector (``model.vision_model.``, ``model.connector.``;
loom/model/vision/smolvlm.py), the Llama decoder (``model.text_model.``) and the LM head
(``lm_head.``).

A prompt holds, per image, its tiles row by row and then its global view, each tile
``image_seq_len`` ``<image>`` tokens after its markers (loom/multimodal/smolvlm.py
expands the template's ``<image>`` so; F = <fake_token_around_image>, L = image_seq_len):

    F <row_1_col_1> <image> x L  F <row_1_col_2> <image> x L  \\n
    F <row_2_col_1> <image> x L  F <row_2_col_2> <image> x L  \\n
    \\n F <global-img> <image> x L  F
        |<- the image's feature: its first <image> .. its last ->|

The tower's rows replace the ``<image>`` tokens' embeddings; the markers between tiles
stay text. The runner fills a feature's whole span from the rows ``embed_multimodal``
returns, so the feature carries the span's token ids (``span_token_ids``) and
``embed_multimodal`` returns a row per span position: the tower's at the ``<image>``
tokens, the markers' own embeddings at theirs. Positions are plain: an image's tokens
count up as text does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from loom.core.wire import MultiModalFeature
from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.models.llama import LlamaForCausalLM
from loom.model.vision import tower_weights_on_the_way

# checkpoint prefix -> ours
_LANGUAGE_PREFIX = "model.text_model."
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")


class SmolVLMForConditionalGeneration(LlamaForCausalLM):
    """Llama with SmolVLM's vision tower beside it. The model runner asks it for an
    image's span rows (``embed_multimodal``) and runs its forward with ``mm_embeds``
    where the step holds image spans."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.smolvlm import SmolVLMVisionTower

        super().__init__(config, tp_group, attention_backend, weight_quantization,
                         expert_parallel)
        self.vision = SmolVLMVisionTower(config, tp_group, weight_quantization)
        self.image_token_id = config.image_token_id

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of ``feature``'s span: (length, hidden_size)."""
        return self.embed_multimodal_batch([feature])[0]

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Images' tiles through the tower in one pass, each image's span rows."""
        for feature in features:
            if feature.modality != "image":
                raise ValueError(f"{type(self).__name__} takes images, not {feature.modality}")
        device = self.model.embed_tokens.weight.device
        pixels = torch.cat([torch.from_numpy(f.data["pixel_values"].to_array())
                            for f in features]).to(device)
        masks = None  # all pixels real, but where an image's processor said otherwise
        if any("pixel_attention_mask" in f.data for f in features):
            masks = torch.cat([_pixel_mask(f) for f in features]).to(device)
        span_ids = [torch.from_numpy(f.data["span_token_ids"].to_array()).to(device)
                    for f in features]
        is_image = [ids == self.image_token_id for ids in span_ids]
        tile_rows = self.vision(pixels, masks)  # (all real tiles' rows, hidden)
        counts = [int(mask.sum()) for mask in is_image]
        if tile_rows.shape[0] != sum(counts):
            raise ValueError(f"the images' tiles make {tile_rows.shape[0]} rows but their "
                             f"spans hold {sum(counts)} <image> tokens; preprocess them with "
                             "loom/multimodal/smolvlm.py")
        out = []
        for feature, ids, mask, rows in zip(features, span_ids, is_image,
                                            tile_rows.split(counts)):
            if ids.shape[0] != feature.length:
                raise ValueError(f"an image's span holds {ids.shape[0]} token ids but fills "
                                 f"{feature.length} tokens")
            span_rows = self.model.embed(ids)  # the markers' own embeddings
            span_rows[mask] = rows.to(span_rows.dtype)
            out.append(span_rows)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mm_embeds``: (indices in the step, rows) of the image spans' tokens, whose
        rows take the place of their embeddings."""
        if mm_embeds is None:
            return self.model(input_ids, positions)
        index, rows = mm_embeds
        inputs_embeds = self.model.embed(input_ids)
        inputs_embeds[index] = rows.to(inputs_embeds.dtype)
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def route(name: str) -> tuple[bool, str]:
            if name.startswith(_VISION_PREFIXES):
                return True, name[len("model."):]
            if name.startswith(_LANGUAGE_PREFIX):
                return False, "model." + name[len(_LANGUAGE_PREFIX):]
            return False, name

        tower: set[str] = set()
        loaded = super().load_weights(tower_weights_on_the_way(weights, route, self.vision,
                                                               tower))
        return loaded | {f"vision.{name}" for name in tower}


def _pixel_mask(feature: MultiModalFeature) -> torch.Tensor:
    """(N, S, S) bool: an image's real pixels, tile by tile."""
    if "pixel_attention_mask" in feature.data:
        return torch.from_numpy(feature.data["pixel_attention_mask"].to_array()).bool()
    num_tiles, _, height, width = feature.data["pixel_values"].shape
    return torch.ones((num_tiles, height, width), dtype=torch.bool)
