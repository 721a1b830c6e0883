"""ERNIE 4.5 VL (``Ernie4_5_VLMoeForConditionalGeneration``): an ERNIE 4.5 MoE language
model that reads images and videos, with modality-isolated experts and 3D rope.

The checkpoint is three parts: the vision tower and its resampler (``model.vision_model.``,
``model.resampler_model.``; loom/model/vision/ernie4_5_vl.py), the decoder (``model.``)
and the LM head (tied to the embeddings by default).

A prompt holds ``<|IMAGE_START|>``, one ``<|IMAGE_PLACEHOLDER|>`` per row the tower makes
of the image (its 14-pixel patch grid merged 2x2), then ``<|IMAGE_END|>``; a video,
``<|VIDEO_START|>``, one ``<|VIDEO_PLACEHOLDER|>`` per row (its frames' grids merged 2x2
and frame pairs merged), ``<|VIDEO_END|>`` (loom/multimodal/ernie4_5_vl.py expands the
placeholders). Those rows take the place of the placeholders' embeddings. Three things
differ from a text ERNIE 4.5 MoE:

- **Experts by modality.** Each sparse layer (``mlp_layer_types``) holds two sets of
  routed experts, each with its own router and correction bias: text experts
  (``mlp``, intermediate ``moe_intermediate_size[0]``) for text tokens, vision experts
  (``vision_moe``, ``moe_intermediate_size[1]``) for an image's or a video's tokens
  *and* its start and end markers; the shared experts run on every token. Checkpoint experts
  ``0 .. E-1`` are the text ones, ``E .. 2E-1`` the vision ones; ``mlp.gate.weight`` and
  ``mlp.gate.weight_1`` are the two routers stored (hidden, E); ``moe_statics.
  e_score_correction_bias`` is (2, E), text row first.
- **Which tokens are vision.** The placeholder tokens of images and videos (those whose
  rows the step takes, ``mm_embeds``) and the prompt's image and video start/end markers
  in requests with either (``mm_markers``: the model runner finds them,
  ``mm_marker_token_ids``), as transformers' processor marks ``moe_mm_token_type_ids``
  over the prompt. A marker the model generates is text, as in transformers' decode
  steps.
- **3D rope.** Positions are transformers' ``get_rope_index`` (``ernie_mrope_positions``):
  text counts up on all three axes; an image starting at position s takes
  (s, s + row, s + column) in its merged grid, a video (s + pair, s + row, s + column),
  its frame pairs one position apart; the text after either resumes at
  s + max(rows, columns), however many pairs a video has. With
  ``mrope_section`` [s, s, t], rope frequency j turns by the height position if
  j < 2s and j is even, by the width position if j < 2s and odd, by the temporal one
  from 2s on (``Ernie4_5_VLRotaryEmbedding``).

A step with vision tokens runs as PyTorch modules (splitting it by modality reads its
mask into Python); any other step, text or decode, routes every token to the text
experts and is replayed from loom's kernels on the CPU (kernel_replay.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from loom.core.wire import MultiModalFeature
from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.layers.fused_moe import FusedMoE, MoESpec, load_expert_weights
from loom.model.layers.layernorm import residual_stream
from loom.model.layers.rotary import (MRotaryEmbedding, RopeStep, RotaryEmbedding,
                                      compute_inv_freq, rope_parameters)
from loom.model.models.ernie4_5 import Ernie4_5ForCausalLM
from loom.model.models.ernie4_5_moe import EXPERT_ROLES
from loom.model.models.llama import DecoderLayerSpec, LlamaDecoderLayer, LlamaModel
from loom.model.vision import tower_weights_on_the_way

_DEFAULT_MROPE_SECTION = [22, 22, 20]  # transformers' where the config names none
# checkpoint prefixes of the vision tower and its resampler (vision_tower: transformers'
# in-memory name of vision_model)
_TOWER_PREFIXES = ("model.vision_model.", "model.vision_tower.", "model.resampler_model.")
_EXPERT = re.compile(r"^(?P<layer>.*\.)mlp\.experts\.(?P<expert>\d+)\.(?P<rest>.+)$")
# a feature's arrays by modality: (pixels, grid)
_ARRAYS = {"image": ("pixel_values", "image_grid_thw"),
           "video": ("pixel_values_videos", "video_grid_thw")}


class Ernie4_5_VLRotaryEmbedding(MRotaryEmbedding):
    """ERNIE 4.5 VL's 3D rope. The checkpoint rotates interleaved pairs (2j, 2j + 1) by
    frequency j; loom makes them halves at load (ernie4_5.py), so frequency j turns dims
    (j, j + D/2) and ``MRotaryEmbedding`` gathers each frequency's cos and sin at its
    axis's position. ``mrope_section`` [s, s, t] (transformers'
    ``recomposition_frequencies``):

        frequency   0  1  2  3 ... 2s-2 2s-1 | 2s ... D/2-1
        axis        h  w  h  w ...  h    w   |  t  ...  t
    """

    def __init__(self, config: Any, head_dim: int) -> None:
        params = rope_parameters(config)
        if params["rope_type"] != "default":
            raise ValueError(f"ERNIE 4.5 VL takes the default rope, not {params['rope_type']!r}")
        section = list(params.get("mrope_section") or _DEFAULT_MROPE_SECTION)
        inv_freq, attention_scaling, rotary_dim = compute_inv_freq(config, head_dim)
        super().__init__(head_dim, rotary_dim, config.max_position_embeddings, inv_freq,
                         attention_scaling, section)
        height, width, _ = section
        if height != width:
            raise ValueError(f"mrope_section {section}: ERNIE 4.5 VL alternates height and "
                             "width frequencies, so its first two sections must be equal")
        axis = [(1 if j % 2 == 0 else 2) if j < 2 * height else 0
                for j in range(rotary_dim // 2)]
        self.axis_of_freq.copy_(torch.tensor(axis))


@dataclass(frozen=True)
class Ernie4_5_VLLayerSpec(DecoderLayerSpec):
    """A decoder layer of ERNIE 4.5 VL: ``moe`` the text experts (and the shared experts'
    size), ``vision_moe`` the vision experts beside them; both None on a dense layer."""

    vision_moe: MoESpec | None = None


class Ernie4_5_VLDecoderLayer(LlamaDecoderLayer):
    """ERNIE 4.5's layer; on a sparse layer ``mlp`` is the text experts with the shared
    experts and ``vision_moe`` the vision experts."""

    def __init__(self, spec: Ernie4_5_VLLayerSpec, layer_idx: int, tp_group: TPGroup,
                 rotary_emb: RotaryEmbedding, attention_backend: str,
                 expert_parallel: EPGroup = NO_EP) -> None:
        super().__init__(spec, layer_idx, tp_group, rotary_emb, attention_backend,
                         expert_parallel)
        self.vision_moe = None if spec.vision_moe is None else FusedMoE(
            spec.vision_moe, spec.hidden_size, tp_group, expert_parallel, None, layer_idx,
            quantization=spec.weight_quantization)

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows``: (text rows, vision rows) of the step where it has vision tokens."""
        if residual is None:
            residual = residual_stream(hidden_states)
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if self.vision_moe is None or rows is None:
            return self.mlp(hidden_states), residual
        return self._experts_by_modality(hidden_states, *rows), residual

    def _experts_by_modality(self, x: torch.Tensor, text_rows: torch.Tensor,
                             vision_rows: torch.Tensor) -> torch.Tensor:
        """Text rows through the text experts, vision rows through the vision experts,
        each plus the shared experts (routed + shared, transformers' order)."""
        out = torch.empty_like(x)
        if text_rows.numel():
            out[text_rows] = self.mlp(x[text_rows])
        vision = x[vision_rows]
        routed = self.vision_moe(vision)
        shared = self.mlp.shared_experts
        out[vision_rows] = routed if shared is None else routed + shared(vision)
        return out


class Ernie4_5_VLTextModel(LlamaModel):
    """The decoder, each sparse layer told which of the step's rows are vision tokens."""

    decoder_layer_cls = Ernie4_5_VLDecoderLayer

    def __init__(self, config: Any, spec: DecoderLayerSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, spec, *args, **kwargs)
        # the rope every layer shares: ERNIE's own frequency-to-axis pattern
        self.rotary_emb = Ernie4_5_VLRotaryEmbedding(config, spec.head_dim)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                vision: torch.Tensor | None = None) -> torch.Tensor:
        """``vision`` (T,) bool: the tokens the vision experts take (None: none)."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.step_inputs(positions, hidden_states.dtype)
        rows = None
        if vision is not None and vision.any():
            rows = ((~vision).nonzero().squeeze(1), vision.nonzero().squeeze(1))
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual, rows)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def ernie_mrope_positions(num_tokens: int, features: list[MultiModalFeature],
                          spatial_merge_size: int, temporal_merge_size: int
                          ) -> tuple[np.ndarray, int]:
    """(3, ``num_tokens``) positions of a prompt whose images and videos are
    ``features``, and the delta that continues them (position ``i`` past the prompt is
    ``i + delta`` on all three axes), as ``Ernie4_5_VLMoeModel.get_rope_index``: text
    counts up from where the last item left off; an item of grid (t, h, w) patches
    starting at position p takes (p + t_i, p + h_i, p + w_i) over its merged grid
    (t / temporal_merge_size frame pairs for a video, 1 for an image; h and w / the
    spatial merge), and the text after it resumes at p + max(h, w) merged.

        text a b, a video of 2 pairs of 1x2 merged rows, text c:
        t  0 1 | 2 2 3 3 | 4      (c at 2 + max(1, 2))
        h  0 1 | 2 2 2 2 | 4
        w  0 1 | 2 3 2 3 | 4
    """
    positions = np.empty((3, num_tokens), np.int64)
    current = previous_end = 0
    for feature in sorted(features, key=lambda f: f.offset):
        positions[:, previous_end:feature.offset] = \
            np.arange(feature.offset - previous_end) + current
        current += feature.offset - previous_end
        t, h, w = (int(v) for v in feature.data[_ARRAYS[feature.modality][1]]
                   .to_array().reshape(-1))
        t //= temporal_merge_size if feature.modality == "video" else 1
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != feature.length:
            raise ValueError(f"an item of merged grid {t}x{h}x{w} fills {t * h * w} "
                             f"placeholder tokens, not {feature.length}")
        grids = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        for axis, grid in enumerate(grids):
            positions[axis, feature.offset:feature.end] = grid.reshape(-1) + current
        current += max(h, w)
        previous_end = feature.end
    positions[:, previous_end:] = np.arange(num_tokens - previous_end) + current
    return positions, int(positions.max()) + 1 - num_tokens


def _split_text_and_vision(weights: Iterable[tuple[str, torch.Tensor]],
                           num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's sparse-layer tensors under loom's names: experts E.. and the
    second router and bias row to the layer's ``vision_moe``, the routers as (E, hidden)."""
    for name, tensor in weights:
        expert = _EXPERT.match(name)
        if expert is not None and int(expert["expert"]) >= num_experts:
            index = int(expert["expert"]) - num_experts
            yield f"{expert['layer']}vision_moe.experts.{index}.{expert['rest']}", tensor
        elif name.endswith(".mlp.gate.weight"):
            yield name, tensor.t()
        elif name.endswith(".mlp.gate.weight_1"):
            yield name.removesuffix("mlp.gate.weight_1") + "vision_moe.gate.weight", tensor.t()
        elif name.endswith(".mlp.moe_statics.e_score_correction_bias"):
            layer = name.removesuffix("mlp.moe_statics.e_score_correction_bias")
            text_bias, vision_bias = tensor.reshape(2, num_experts)
            yield f"{layer}mlp.e_score_correction_bias", text_bias
            yield f"{layer}vision_moe.e_score_correction_bias", vision_bias
        else:
            yield name, tensor


class Ernie4_5_VLMoeForConditionalGeneration(Ernie4_5ForCausalLM):
    """The ERNIE 4.5 MoE decoder with the vision tower beside it. The model runner asks
    it for an image's or a video's rows (``embed_multimodal``), for a prompt's positions
    (``mrope_positions``), and runs its forward with ``mm_embeds`` where the step holds
    their tokens."""

    model_cls = Ernie4_5_VLTextModel

    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        bias = bool(getattr(config, "use_bias", False))
        return Ernie4_5_VLLayerSpec.from_config(config, qkv_bias=bias, o_bias=bias,
                                                mlp_bias=bias)

    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        text_size, vision_size = config.moe_intermediate_size
        text = MoESpec(num_experts=config.moe_num_experts, top_k=config.moe_k,
                       intermediate_size=text_size, renormalize=True,
                       renormalize_min=config.moe_norm_min, correction_bias=True,
                       shared_intermediate_size=text_size * config.moe_num_shared_experts)
        sparse = replace(spec, moe=text, vision_moe=replace(
            text, intermediate_size=vision_size, shared_intermediate_size=0))
        layer_types = getattr(config, "mlp_layer_types", None) or \
            ["dense"] + ["sparse"] * (config.num_hidden_layers - 1)  # transformers' default
        return [sparse if layer_type == "sparse" else spec for layer_type in layer_types]

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.ernie4_5_vl import Ernie4_5_VLVisionTower

        super().__init__(config, tp_group, attention_backend, weight_quantization,
                         expert_parallel)
        self.vision_tower = Ernie4_5_VLVisionTower(config, tp_group, weight_quantization)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.temporal_merge_size = config.vision_config.temporal_merge_size
        # prompt tokens the vision experts take beside an image's rows (the runner finds
        # them: _prompt_markers)
        self.mm_marker_token_ids = frozenset((
            config.image_start_token_id, config.image_end_token_id,
            config.video_start_token_id, config.video_end_token_id))

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of ``feature``'s placeholder tokens (an image's, or a video's: its
        frames through the same tower, paired in its resampler): (length, hidden_size)."""
        if feature.modality not in _ARRAYS:
            raise ValueError(f"{type(self).__name__} takes images and videos, not "
                             f"{feature.modality}")
        pixels_name, grid_name = _ARRAYS[feature.modality]
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.from_numpy(feature.data[pixels_name].to_array()).to(dtype)
        grid = torch.from_numpy(feature.data[grid_name].to_array()).reshape(-1, 3)
        return self.vision_tower(pixels, grid)

    def mrope_positions(self, num_tokens: int, features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray, int]:
        return ernie_mrope_positions(num_tokens, features, self.spatial_merge_size,
                                     self.temporal_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                mm_markers: torch.Tensor | None = None) -> torch.Tensor:
        """``mm_embeds``: (indices in the step, rows) of image and video tokens, whose
        rows take the place of their embeddings; ``positions`` (3, T) where the step has them.
        ``mm_markers``: indices of the prompt's image/video markers in the step. The
        vision experts take both; without either, every token is text."""
        if mm_embeds is None and mm_markers is None:
            return self.model(input_ids, positions)
        vision = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        if mm_markers is not None:
            vision[mm_markers] = True
        if mm_embeds is None:
            return self.model(input_ids, positions, vision=vision)
        index, rows = mm_embeds
        inputs_embeds = self.model.embed(input_ids)
        inputs_embeds[index] = rows.to(inputs_embeds.dtype)
        vision[index] = True
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds, vision=vision)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def route(name: str) -> tuple[bool, str]:
            if name.startswith(_TOWER_PREFIXES):
                return True, name.removeprefix("model.")
            return False, name

        tower: set[str] = set()
        language = tower_weights_on_the_way(weights, route, self.vision_tower, tower)
        loaded: set[str] = set()
        rest = load_expert_weights(
            _split_text_and_vision(language, self.config.moe_num_experts), self, loaded,
            EXPERT_ROLES)
        loaded |= super().load_weights(rest)
        return loaded | {f"vision_tower.{name}" for name in tower}
