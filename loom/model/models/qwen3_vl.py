"""Qwen3-VL: a Qwen3 language model that reads images, with interleaved M-RoPE and
deepstack.

The checkpoint's ``Qwen3VLForConditionalGeneration`` is three parts, each loaded from
its own prefix: the vision tower (``model.visual.``, loom/model/vision/qwen3_vl.py),
the Qwen3 decoder (``model.language_model.``, qk-norm) and the LM head (``lm_head.``).

A prompt holds ``<|vision_start|>``, one ``<|image_pad|>`` per row the tower makes of
the image (its 16-pixel patch grid merged 2x2), then ``<|vision_end|>``, as Qwen2.5-VL;
positions are Qwen2.5-VL's too (``qwen_vl_mrope_positions``). A video is a timestamp and
such a span (``<|video_pad|>``) per temporal patch (two frames), each patch its own
feature of grid (1, h, w) (loom/multimodal/qwen3_vl.py), so its positions are an
image's, as transformers' ``get_rope_index`` splits a video's grid. Two things differ:

- the rope deals its frequencies out to the three axes in turn (``mrope_interleaved``:
  t h w t h w ...) rather than in three runs; Hugging Face interleaves whatever the
  config says, so loom does too;
- deepstack: the tower gives each image token more than its embedding,

      rows (N, hidden * (1 + L)):  | main | deepstack 0 | ... | deepstack L-1 |

  the main rows take the place of the placeholder tokens' embeddings, and deepstack
  level i is added to those tokens' hidden states after decoder layer i (i < L).

The model runner hands a step only the rows of the image (and video) tokens it runs
(``mm_embeds``), so a chunk that holds part of an image adds the deepstack columns of
exactly those tokens, and the next chunk the rest. Video tokens take deepstack rows as
image tokens do (transformers adds both kinds' at their positions).
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
from loom.model.models.llama import LlamaModel
from loom.model.models.qwen2_5_vl import qwen_vl_mrope_positions, qwen_vl_weight_route
from loom.model.models.qwen3 import Qwen3ForCausalLM
from loom.model.vision import tower_weights_on_the_way

_DEFAULT_MROPE_SECTION = [24, 20, 20]  # Hugging Face's where the config names none
# a feature's arrays by modality: (pixels, grid)
_ARRAYS = {"image": ("pixel_values", "image_grid_thw"),
           "video": ("pixel_values_videos", "video_grid_thw")}


def _with_interleaved_mrope(config: Any) -> Any:
    """``config`` whose rope parameters name the M-RoPE sections (the checkpoint's, else
    Hugging Face's default) and interleave them, so that ``get_rope`` builds
    Qwen3-VL's rope."""
    params = rope_parameters(config)
    if params.get("mrope_section") and params.get("mrope_interleaved"):
        return config
    config = copy.copy(config)
    params.setdefault("mrope_section", list(_DEFAULT_MROPE_SECTION))
    params["mrope_interleaved"] = True
    config.rope_parameters = params
    return config


class Qwen3VLTextModel(LlamaModel):
    """The Qwen3 decoder, taking deepstack rows after its first layers."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``deepstack``: (indices in the step, levels (L, N, hidden)) of the step's image
        tokens; level i joins their hidden states after layer i."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.step_inputs(positions, hidden_states.dtype)
        index, levels = deepstack if deepstack is not None else (None, ())
        residual = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(rope, hidden_states, residual)
            # the layer's output is hidden_states + residual, its add deferred to the
            # next norm: adding the level to the residual adds it to the output
            if i < len(levels):
                residual[index] += levels[i].to(residual.dtype)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    """Qwen3 with the vision tower beside it. The model runner asks it for an image's
    rows (``embed_multimodal``), for a prompt's positions (``mrope_positions``), and
    runs its forward with ``mm_embeds`` where the step holds image tokens."""

    model_cls = Qwen3VLTextModel

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.qwen3_vl import Qwen3VLVisionTower

        super().__init__(_with_interleaved_mrope(config), tp_group, attention_backend,
                         weight_quantization, expert_parallel)
        self.visual = Qwen3VLVisionTower(config, tp_group, weight_quantization)
        if self.visual.out_hidden_size != config.hidden_size:
            raise ValueError(f"the vision tower's out_hidden_size "
                             f"{self.visual.out_hidden_size} is not the language model's "
                             f"hidden_size {config.hidden_size}")
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of ``feature``'s placeholder tokens (an image's, or a video's temporal
        patch's), main and deepstack side by side:
        (length, hidden_size * (1 + deepstack levels))."""
        return self.embed_multimodal_batch([feature])[0]

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Items of one modality through the tower in one pass (their patches side by
        side, each frame attending within itself), each item's rows."""
        if features[0].modality not in _ARRAYS:
            raise ValueError(f"{type(self).__name__} takes images and videos, not "
                             f"{features[0].modality}")
        pixels_name, grid_name = _ARRAYS[features[0].modality]
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.cat([torch.from_numpy(f.data[pixels_name].to_array())
                            for f in features]).to(dtype)
        grid = torch.cat([torch.from_numpy(f.data[grid_name].to_array()).reshape(-1, 3)
                          for f in features])
        return list(self.visual(pixels, grid).split([f.length for f in features]))

    def mrope_positions(self, num_tokens: int, features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray, int]:
        return qwen_vl_mrope_positions(num_tokens, features, self.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mm_embeds``: (indices in the step, rows) of image and video tokens, whose
        main rows take the place of their embeddings and whose deepstack rows join the first
        layers' outputs; ``positions`` (3, T) where the step has them."""
        if mm_embeds is None:
            return self.model(input_ids, positions)
        index, rows = mm_embeds
        inputs_embeds = self.model.embed(input_ids)
        hidden_size = inputs_embeds.shape[-1]
        rows = rows.to(inputs_embeds.dtype)  # (N, hidden * (1 + L))
        inputs_embeds[index] = rows[:, :hidden_size]
        levels = rows[:, hidden_size:].unflatten(1, (-1, hidden_size)).transpose(0, 1)
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds,
                          deepstack=(index, levels))  # levels (L, N, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tower: set[str] = set()
        loaded = super().load_weights(tower_weights_on_the_way(weights, qwen_vl_weight_route,
                                                               self.visual, tower))
        return loaded | {f"visual.{name}" for name in tower}
