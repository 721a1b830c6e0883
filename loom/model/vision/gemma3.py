"""Gemma 3's vision tower: a SigLIP encoder and the multimodal projector.

    pixel_values (I, 3, S, S)                       S = image_size, p = patch_size
      -> patches (I * G * G, 3 * p * p)             G = S // p, row-major over the grid
      -> patch_embedding + position_embedding       the conv as a linear over patches
      -> encoder layers (pre-LayerNorm, bidirectional attention within an image,
         GELU-tanh MLP), post_layernorm             (I, G * G, D)
      -> average pool of the grid to T x T          T * T = mm_tokens_per_image
      -> Gemma RMSNorm, projection to the text size (I * T * T, text hidden_size)

Every image is the processor's fixed square (no pan-and-scan), so the tower runs the
batch as one (I, G * G, D) tensor. Attention heads and the MLP's hidden features are
split over the tensor-parallel ranks; the patch embedding and the projector are
replicated.

Checkpoint names, relative to ``model.``: ``vision_tower.vision_model.<x>`` (the
original files) or ``vision_tower.<x>`` (as transformers 5 saves them), and
``multi_modal_projector.<y>``. ``load_weights`` turns them into this module's own:

- q_proj, k_proj, v_proj -> qkv_proj (fused);
- the patch embedding's conv weight (D, 3, p, p) -> (D, 3 * p * p), in the order
  ``_patches`` flattens a patch;
- ``mm_input_projection_weight`` (D, text hidden) -> ``mm_input_projection.weight``,
  transposed;
- ``mm_soft_emb_norm.weight`` is stored as an offset from 1 (``x * (1 + w)``): 1 is
  added at load, so the projector runs loom's RMSNorm;
- SigLIP's attention-pooling ``head`` (``vision_use_head``) is skipped: Gemma 3 reads
  the encoder's last hidden state, never the pooled one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.layernorm import RMSNorm
from loom.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    quantization_for_inputs,
    default_weight_loader,
)
from loom.model.vision import in_passes

_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
           "v_proj": ("qkv_proj", "v")}


class SiglipAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"vision hidden_size {hidden_size} is not divisible by its "
                             f"{num_heads} attention heads")
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_heads,
                                          bias=True, tp_group=tp_group,
                                          quantization=quantization_for_inputs(quantization,
                                                                               hidden_size))
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=True,
                                          tp_group=tp_group,
                                          quantization=quantization_for_inputs(
                                              quantization, hidden_size // tp_group.world_size))

    def forward(self, hidden_states: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each image's (or tile's) patches over its own; ``key_mask`` (I, N) bool: the
        keys that are real patches (SmolVLM's padded tiles), None where all are."""
        num_images, num_patches, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states.flatten(0, 1))  # (I * N, 3 * H * D): | q | k | v |
        # (3, I, H, N, D)
        q, k, v = qkv.view(num_images, num_patches, 3, self.num_heads,
                           self.head_dim).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        # (I, H, N, D), scale D ** -0.5
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(num_images * num_patches, -1)
        return self.out_proj(out).view(num_images, num_patches, -1)


class SiglipMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            hidden_size, intermediate_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization, hidden_size))
        self.fc2 = RowParallelLinear(
            intermediate_size, hidden_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization,
                                                 intermediate_size // tp_group.world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vision: Any, tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.self_attn = SiglipAttention(vision.hidden_size, vision.num_attention_heads,
                                         tp_group, quantization)
        self.layer_norm2 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.mlp = SiglipMLP(vision.hidden_size, vision.intermediate_size, tp_group,
                             quantization)

    def forward(self, hidden_states: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states),
                                                       key_mask)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class SiglipVisionModel(nn.Module):
    """SigLIP's encoder: patches in, the post-LayerNorm'd last hidden state out.
    ``quantization``: what its layers' linears hold (``--quantization``'s wint8 or wint4);
    the patch embedding stays in the model's dtype."""

    def __init__(self, vision: Any, tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        if vision.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {vision.hidden_act!r} is not supported; "
                             "SigLIP uses gelu_pytorch_tanh")
        self.patch_size = vision.patch_size
        self.grid_size = vision.image_size // vision.patch_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = ReplicatedLinear(
            vision.num_channels * vision.patch_size ** 2, vision.hidden_size, bias=True)
        self.embeddings.position_embedding = nn.Embedding(self.grid_size ** 2,
                                                          vision.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(vision, tp_group, quantization)
                                            for _ in range(vision.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)

    def _patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(I, C, G * p, G * p) -> (I * G * G, C * p * p): patch (row, col) at row
        ``row * G + col`` of its image, each flattened as (channel, y, x), the order of
        the conv weight's (C, p, p)."""
        num_images, channels, height, width = pixel_values.shape
        p, grid = self.patch_size, self.grid_size
        if height != grid * p or width != grid * p:
            raise ValueError(f"pixel_values are {height}x{width} but the vision tower takes "
                             f"{grid * p}x{grid * p} images; preprocess them with the "
                             "checkpoint's own image processor")
        patches = pixel_values.view(num_images, channels, grid, p, grid, p)
        return patches.permute(0, 2, 4, 1, 3, 5).reshape(num_images * grid * grid, -1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(I, C, S, S) -> (I, G * G, D)."""
        position_table = self.embeddings.position_embedding.weight
        patches = self._patches(pixel_values.to(position_table.dtype))
        hidden_states = self.embeddings.patch_embedding(patches).view(
            pixel_values.shape[0], self.grid_size ** 2, -1) + position_table
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states)
        return self.post_layernorm(hidden_states)


def siglip_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor, str | None]:
    """A SigLIP encoder's checkpoint tensor as this module's (name, tensor, shard id):
    q_proj, k_proj, v_proj into qkv_proj's shards; the patch embedding's conv weight
    (D, C, p, p) flattened to (D, C * p * p); others as they are."""
    if name.endswith("patch_embedding.weight"):
        return name, tensor.reshape(tensor.shape[0], -1), None
    for ckpt_name, (packed_name, packed_shard) in _PACKED.items():
        if f".{ckpt_name}." in name:
            return name.replace(f".{ckpt_name}.", f".{packed_name}."), tensor, packed_shard
    return name, tensor, None


class Gemma3MultiModalProjector(nn.Module):
    """The encoder's (I, G * G, D) grid, average-pooled to (I, T * T, D), normed and
    projected to (I * T * T, text hidden_size)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        grid_size = vision.image_size // vision.patch_size
        self.tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if self.tokens_per_side ** 2 != config.mm_tokens_per_image \
                or grid_size % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} must be the "
                             f"square of a number that divides the {grid_size}x{grid_size} "
                             "patch grid")
        self.grid_size = grid_size
        self.pool_size = grid_size // self.tokens_per_side
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.mm_input_projection = ReplicatedLinear(vision.hidden_size,
                                                    config.text_config.hidden_size)

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        num_images, _, hidden_size = vision_outputs.shape
        # (I, G * G, D) -> (I, D, G, G) -> (I, D, T, T) -> (I * T * T, D), row-major
        grid = vision_outputs.transpose(1, 2).reshape(num_images, hidden_size,
                                                      self.grid_size, self.grid_size)
        pooled = F.avg_pool2d(grid, self.pool_size)
        pooled = pooled.flatten(2).transpose(1, 2).reshape(-1, hidden_size)
        return self.mm_input_projection(self.mm_soft_emb_norm(pooled))


class Gemma3VisionTower(nn.Module):
    """Pixels to the rows that replace Gemma 3's image soft tokens: per image,
    ``mm_tokens_per_image`` rows of the text hidden size."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        super().__init__()
        self.mm_tokens_per_image = config.mm_tokens_per_image
        self.vision_tower = SiglipVisionModel(config.vision_config, tp_group, quantization)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """``pixel_values`` (I, 3, S, S) from ``Gemma3ImageProcessor`` (``grid_thw``:
        None, Gemma 3 has none) -> (I * mm_tokens_per_image, text hidden_size), image by
        image, in the model's dtype."""
        if grid_thw is not None:
            raise ValueError("Gemma 3's vision tower takes no grid_thw: its images are all "
                             "the processor's fixed square")
        # images in passes of at most PASS_ROWS patches: at 896 x 896 (4,096 patches) one
        # image a pass, its activations reused by the next rather than faulted in afresh
        images = pixel_values.shape[0]
        return in_passes(lambda pixels, _: self.multi_modal_projector(self.vision_tower(pixels)),
                         pixel_values, [None] * images,
                         [self.vision_tower.grid_size ** 2] * images, pixel_rows=[1] * images)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named relative to ``model.`` (``vision_tower.…``,
        ``multi_modal_projector.…``) into this rank's shards; returns the names of the
        parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            if name.startswith("vision_tower.head."):
                continue  # SigLIP's pooling head: Gemma 3 never runs it
            shard_id = None
            if name == "multi_modal_projector.mm_input_projection_weight":
                name, tensor = "multi_modal_projector.mm_input_projection.weight", tensor.t()
            elif name == "multi_modal_projector.mm_soft_emb_norm.weight":
                tensor = tensor.float() + 1.0
            else:
                name, tensor, shard_id = siglip_tensor(name, tensor)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is it a Gemma 3 vision tower's?")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        return loaded
