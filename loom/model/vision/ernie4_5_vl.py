"""ERNIE 4.5 VL's vision tower: a ViT over 14-pixel patches with 2D rope, then the
variable-resolution resampler that turns each 2x2 block of patches (and each pair of
video frames) into one row in the language model's hidden size.

    pixel_values (num_patches, C*p*p)   the processor's patches, each 2x2 block's 4 in a row
      vision_model: patch_embed (a linear) -> blocks (attention within each frame) -> ln
      resampler_model: 4 patches -> 1 row -> spatial_linear (fc1, GELU, fc2, LayerNorm)
                       frame pairs -> 1 row -> temporal_linear (an image is paired with itself)
                       -> mlp (to the text hidden size) -> after_norm (RMSNorm)
    -> (num_placeholder_tokens, text hidden size), image by image

An image of grid (1, h, w) gives h * w / 4 rows; a video of grid (t, h, w), t >= 2,
gives (t // 2) * h * w / 4 (frames 0 and 1 make one row per block, 2 and 3 the next...).

Checkpoint names, relative to ``model.``: ``vision_model.*`` (``vision_tower.*`` in a
checkpoint saved with transformers' in-memory names) and ``resampler_model.*``, whose
MLPs are stored as ``nn.Sequential`` indices (``spatial_linear.0`` fc1, ``.2`` fc2,
``.3`` ln).
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
    default_weight_loader,
    quantization_for_inputs,
)
from loom.model.vision import in_passes, rope_attention_within

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
}

# checkpoint name pieces -> this module's
_CHECKPOINT_RENAMES = {
    "vision_tower.": "vision_model.", "patch_embed.proj.": "patch_embed.",
    "spatial_linear.0.": "spatial_linear.fc1.", "spatial_linear.2.": "spatial_linear.fc2.",
    "spatial_linear.3.": "spatial_linear.ln.",
    "temporal_linear.0.": "temporal_linear.fc1.", "temporal_linear.2.": "temporal_linear.fc2.",
    "temporal_linear.3.": "temporal_linear.ln.",
}


def patch_positions(grid_thw: list[list[int]], merge_size: int) -> torch.Tensor:
    """(num_patches, 2) (row, column) of every patch in the processor's order: merge
    blocks row-major, the patches of a block row-major within it, each frame alike.
    A 2x4 grid, merge 2: rows [0, 0, 1, 1, 0, 0, 1, 1], columns [0, 1, 0, 1, 2, 3, 2, 3]."""
    positions = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(positions)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2D rope: the same head_dim/4 frequencies for rows and columns, laid out
    ``[row, column, row, column]`` over the head (the rotation pairs i and i + D/2)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` (N, 2) -> cos, sin (N, head_dim) in float32."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (N, 2, D/4)
        half = freqs.flatten(1)  # (N, D/2): rows' D/4, then columns'
        angles = torch.cat([half, half], dim=-1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame over this rank's heads."""

    def __init__(self, hidden_size: int, num_heads: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        head_dim = hidden_size // num_heads
        self.qkv = QKVParallelLinear(hidden_size, head_dim, num_heads, num_heads, bias=True,
                                     tp_group=tp_group,
                                     quantization=quantization_for_inputs(quantization,
                                                                          hidden_size))
        self.proj = RowParallelLinear(hidden_size, hidden_size, bias=True, tp_group=tp_group,
                                      quantization=quantization_for_inputs(
                                          quantization, hidden_size // tp_group.world_size))
        self.num_heads, self.head_dim = self.qkv.num_heads, head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frame_lengths: list[int]) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_dim).unbind(1)
        # cos, sin (N, 1, D) over the heads; no patch attends outside its own frame
        return self.proj(rope_attention_within(q, k, v, cos[:, None], sin[:, None],
                                               frame_lengths))


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported; expected one of "
                             f"{sorted(_ACTIVATIONS)}")
        self.fc1 = ColumnParallelLinear(
            hidden_size, intermediate_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization, hidden_size))
        self.act = _ACTIVATIONS[act]
        self.fc2 = RowParallelLinear(
            intermediate_size, hidden_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization,
                                                 intermediate_size // tp_group.world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vision_config: Any, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        hidden_size, eps = vision_config.hidden_size, vision_config.rms_norm_eps
        self.norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.attn = VisionAttention(hidden_size, vision_config.num_heads, tp_group,
                                    quantization)
        self.norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = VisionMLP(hidden_size, vision_config.intermediate_size,
                             vision_config.hidden_act, tp_group, quantization)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frame_lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lengths)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Patches (num_patches, C*p*p) -> (num_patches, vision hidden size)."""

    def __init__(self, vision_config: Any, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        patch_size = vision_config.patch_size
        patch_h, patch_w = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
        hidden_size = vision_config.hidden_size
        self.merge_size = vision_config.spatial_merge_size
        # the processor flattens each patch (C, ph, pw): the conv is this matmul
        self.patch_embed = ReplicatedLinear(vision_config.in_channels * patch_h * patch_w,
                                            hidden_size, bias=False, tp_group=tp_group)
        rope = getattr(vision_config, "rope_parameters", None) or {}
        self.rotary_pos_emb = VisionRotaryEmbedding(hidden_size // vision_config.num_heads,
                                                    rope.get("rope_theta", 10000.0))
        self.blocks = nn.ModuleList(VisionBlock(vision_config, tp_group, quantization)
                                    for _ in range(vision_config.depth))
        self.ln = nn.LayerNorm(hidden_size, eps=vision_config.rms_norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixel_values.to(self.ln.weight.dtype))
        positions = patch_positions(grid_thw, self.merge_size).to(x.device)
        cos, sin = self.rotary_pos_emb(positions)
        frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lengths)
        return self.ln(x)


class ResamplerMLP(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, eps: float, tp_group: TPGroup) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(in_dim, out_dim, bias=True, tp_group=tp_group)
        self.fc2 = RowParallelLinear(out_dim, out_dim, bias=True, tp_group=tp_group)
        self.ln = nn.LayerNorm(out_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc2(F.gelu(self.fc1(x))))


class Resampler(nn.Module):
    """(num_patches, vision hidden) -> (num_placeholder_tokens, text hidden)."""

    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__()
        vision_config = config.vision_config
        if vision_config.temporal_merge_size != 2:
            raise ValueError(f"ERNIE 4.5 VL's resampler pairs frames two by two; "
                             f"temporal_merge_size {vision_config.temporal_merge_size} is "
                             "not supported")
        self.merge_size = vision_config.spatial_merge_size
        spatial_dim = vision_config.hidden_size * self.merge_size ** 2
        eps = vision_config.rms_norm_eps
        self.spatial_linear = ResamplerMLP(spatial_dim, spatial_dim, eps, tp_group)
        self.temporal_linear = ResamplerMLP(2 * spatial_dim, spatial_dim, eps, tp_group)
        text_config = config.text_config
        self.mlp = ReplicatedLinear(spatial_dim, text_config.hidden_size, bias=True,
                                    tp_group=tp_group)
        self.after_norm = RMSNorm(text_config.hidden_size, eps=text_config.rms_norm_eps)

    def forward(self, x: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        # the processor puts each block's merge_size**2 patches in consecutive rows
        x = self.spatial_linear(x.reshape(-1, x.shape[-1] * self.merge_size ** 2))
        x = self.temporal_linear(self._pair_frames(x, grid_thw))
        return self.after_norm(self.mlp(x))

    def _pair_frames(self, x: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """Each block's row beside the same block's row one frame later: frames
        (0, 1), (2, 3) ... of a video (an odd last frame is dropped), (0, 0) of an image.
        (t * blocks, S) -> (max(t // 2, 1) * blocks, 2S) per image or video."""
        paired = []
        for frames, (t, h, w) in zip(x.split([t * h * w // self.merge_size ** 2
                                              for t, h, w in grid_thw]), grid_thw):
            frames = frames.view(t, -1, frames.shape[-1])  # (t, blocks, S)
            if t == 1:
                first, second = frames, frames
            else:
                first, second = frames[0:t - 1:2], frames[1::2]
            paired.append(torch.cat([first, second], dim=-1).flatten(0, 1))
        return torch.cat(paired)


class Ernie4_5_VLVisionTower(nn.Module):
    """ERNIE 4.5 VL's pixels -> the rows of its image (and video) placeholder tokens.

    Reads ``config.vision_config`` (depth, hidden_size, num_heads, intermediate_size,
    hidden_act, in_channels, patch_size, spatial_merge_size, temporal_merge_size,
    rms_norm_eps, rope_parameters.rope_theta) and ``config.text_config`` (hidden_size,
    rms_norm_eps: the resampler's output and its RMSNorm). Heads, the MLPs'
    intermediate features and the resampler's MLPs are split over ``tp_group``.
    ``quantization``: what the blocks' linear layers hold (``--quantization``'s wint8 or
    wint4, as the decoder's); the patch embedding and resampler stay in the model's
    dtype."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        super().__init__()
        self.vision_model = VisionTransformer(config.vision_config, tp_group, quantization)
        self.resampler_model = Resampler(config, tp_group)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``pixel_values`` (num_patches, C*p*p) and ``grid_thw`` (num_images, 3) as the
        family's image processor returns them -> (sum of h * w / 4 over the images,
        text hidden size) in the model's dtype, image by image."""
        if grid_thw is None:
            raise ValueError("ERNIE 4.5 VL needs image_grid_thw with its pixel_values")
        grid = grid_thw.tolist()
        return in_passes(lambda pixels, grids: self.resampler_model(
            self.vision_model(pixels, grids), grids), pixel_values, grid,
            [t * h * w for t, h, w in grid])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named relative to ``model.`` (``vision_model.blocks.0.attn.qkv
        .weight``, ``resampler_model.spatial_linear.0.weight`` ...) into this rank's
        shards; returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            for checkpoint_piece, piece in _CHECKPOINT_RENAMES.items():
                name = name.replace(checkpoint_piece, piece)
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; the tower takes names under the "
                                 "checkpoint's model.vision_model. and model.resampler_model.")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if ".attn.qkv." in name:  # fused [q | k | v] rows, split to shard each by heads
                for shard_id, shard in zip("qkv", loaded_weight.chunk(3)):
                    weight_loader(param, shard, shard_id)
            else:
                weight_loader(param, loaded_weight)
            loaded.add(name)
        return loaded
