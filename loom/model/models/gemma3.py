"""Gemma 3 (text) for causal LM.

Llama's layer with these differences, each declared once:

- layers alternate local and global attention (``config.layer_types``): a local layer
  attends over the last ``sliding_window`` tokens and has its own rope base
  (``rope_parameters["sliding_attention"]``), a global one over all tokens;
- attention scaled by ``query_pre_attn_scalar ** -0.5``, a per-head RMSNorm on q and k;
- four norms per layer (a "sandwich"): the attention output and the MLP output are each
  normed before joining the residual stream, the MLP input after it;
- GELU (tanh) between gate and up; embeddings multiplied by ``sqrt(hidden_size)``;
  logits soft-capped where ``final_logit_softcapping`` is set;
- RMSNorm weights stored as offsets from 1 (``x * (1 + w)``): 1 is added at load, so
  the layers run loom's RMSNorm (a GGUF file already stores ``1 + w``).

``Gemma3ForConditionalGeneration`` is this decoder reading images too: the SigLIP tower
and projector of loom/model/vision/gemma3.py make each image's rows, which take the place
of its ``<image_soft_token>`` embeddings; those tokens attend to each other both ways.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from loom.core.wire import MultiModalFeature
from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.layers.layernorm import RMSNorm, residual_stream
from loom.model.layers.rotary import RopeStep
from loom.model.models.llama import (DecoderLayerSpec, LlamaDecoderLayer, LlamaForCausalLM,
                                     LlamaModel)
from loom.model.vision import tower_weights_on_the_way


def _rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type])
    # configs written before rope_parameters: rope_theta and rope_local_base_freq
    theta = getattr(config, "rope_local_base_freq", 10000.0) if layer_type == \
        "sliding_attention" else getattr(config, "rope_theta", 1000000.0)
    return {"rope_type": "default", "rope_theta": theta}


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, spec: DecoderLayerSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # residual stream r:  r += post_attn_norm(attn(input_norm(r)))
        #                     r += post_ff_norm(mlp(pre_ff_norm(r)))
        # with each "r +=" fused into the next norm, as Llama's layer does.
        if residual is None:
            residual = residual_stream(hidden_states)
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(rope, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(LlamaModel):
    decoder_layer_cls = Gemma3DecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # as Hugging Face: the scale rounded to the model's dtype first
        scale = torch.tensor(self.spec.hidden_size ** 0.5, dtype=hidden_states.dtype)
        return hidden_states * scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model

    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        """The spec of a global layer."""
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping (Gemma 2's) is not supported; Gemma 3 "
                             "checkpoints leave it unset")
        return DecoderLayerSpec.from_config(
            config, qk_norm=True, activation=config.hidden_activation,
            attention_scale=config.query_pre_attn_scalar ** -0.5,
            rope_parameters=_rope_parameters(config, "full_attention"))

    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        local = replace(spec, sliding_window=config.sliding_window,
                        rope_parameters=_rope_parameters(config, "sliding_attention"))
        return [local if layer_type == "sliding_attention" else spec
                for layer_type in config.layer_types]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # as Hugging Face: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_norms_from_offsets(weights))


def _norms_from_offsets(
        weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor


# checkpoint prefix of the decoder -> ours: published checkpoints' names, then the ones
# transformers 5 gives the model in memory
_LANGUAGE_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                      "model.language_model.": "model."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with images: the text decoder above, and the vision tower beside it.

    A prompt holds, per image, ``\\n\\n<start_of_image>``, ``mm_tokens_per_image``
    ``<image_soft_token>``, ``<end_of_image>\\n\\n`` (loom/multimodal/gemma3.py expands
    the template's ``<start_of_image>`` so). The soft tokens' embeddings are the tower's
    rows, put in after the embeddings' ``sqrt(hidden_size)`` scaling (rows unscaled, as
    Hugging Face merges them). Those tokens attend to each other both ways, as Hugging
    Face's ``token_type_ids`` mask (causal, or the same image; on sliding layers still
    within the window): the processor marks their features ``bidirectional``, and the
    scheduler and the attention layers take it from there (core/wire.py). Positions are
    plain: an image's tokens count up as text does.

    Checkpoint names: the decoder under ``language_model.model.`` (published) or
    ``model.language_model.`` (transformers 5), the tower under ``vision_tower.`` and
    ``multi_modal_projector.`` (either bare or under ``model.``).
    """

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        from loom.model.vision.gemma3 import Gemma3VisionTower

        super().__init__(config, tp_group, attention_backend, weight_quantization,
                         expert_parallel)
        self.vision = Gemma3VisionTower(config, tp_group, weight_quantization)

    # ---- what the model runner asks of a multimodal model --------------------------

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The rows of ``feature``'s soft tokens: (mm_tokens_per_image, hidden_size)."""
        if feature.modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {feature.modality}")
        if not feature.bidirectional:
            raise ValueError("Gemma 3's image tokens attend to each other both ways, but this "
                             "image's feature is not marked bidirectional; make it with "
                             "loom/multimodal/gemma3.py")
        pixels = torch.from_numpy(feature.data["pixel_values"].to_array())
        rows = self.vision(pixels.to(self.model.embed_tokens.weight.device))
        if rows.shape[0] != feature.length:
            raise ValueError(f"an image makes {rows.shape[0]} rows but fills "
                             f"{feature.length} placeholder tokens")
        return rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mm_embeds``: (indices in the step, rows) of image tokens, whose rows take
        the place of their scaled embeddings."""
        if mm_embeds is None:
            return self.model(input_ids, positions)
        index, rows = mm_embeds
        # the image token may lie past the text vocabulary: embed id 0 there, as Hugging
        # Face does, before the rows replace it
        inputs_embeds = self.model.embed(input_ids.index_fill(0, index, 0))
        inputs_embeds[index] = rows.to(inputs_embeds.dtype)
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def route(name: str) -> tuple[bool, str]:
            if name.startswith("model.") and name[len("model."):].startswith(_VISION_PREFIXES):
                name = name[len("model."):]
            if name.startswith(_VISION_PREFIXES):
                return True, name
            for prefix, ours in _LANGUAGE_PREFIXES.items():
                if name.startswith(prefix):
                    return False, ours + name[len(prefix):]
            return False, name

        tower: set[str] = set()
        loaded = super().load_weights(tower_weights_on_the_way(weights, route, self.vision,
                                                               tower))
        return loaded | {f"vision.{name}" for name in tower}
