"""Qwen3-VL's vision tower (``model.visual.`` in the checkpoint), tensor parallel.

Pixels arrive as the image processor made them (``Qwen2VLImageProcessor`` with patch
size 16): one row per patch of ``in_channels x temporal_patch_size x patch x patch``
values, an image's patches in merge-block order, so that the ``merge x merge`` patches
that become one placeholder token are consecutive rows:

    grid h=4, w=4, merge 2 -> rows (row, col): (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) | ...

The tower embeds each patch (the checkpoint's Conv3d, whose stride is its kernel, as
a linear over the flattened patch), adds the learned square grid of position
embeddings resampled to the image's grid, and runs ``depth`` pre-LayerNorm blocks
with a 2D rope (rows rotate half of each head, columns the other half), each frame
attending only to itself. After the blocks named in ``deepstack_visual_indexes`` a
deepstack merger turns the hidden states into language-model rows too; the main
merger does so after the last block. ``forward`` returns them side by side:

    (num_tokens, out_hidden_size * (1 + num_deepstack_levels)):
    | main (placeholder embeddings) | deepstack 0 | deepstack 1 | ... |

The language model puts the main rows in place of the placeholder tokens' embeddings
and adds deepstack level i to those tokens' hidden states after its decoder layer i.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    quantization_for_inputs,
    default_weight_loader,
)
from loom.model.layers.rotary import rope_parameters
from loom.model.vision import in_passes, rope_attention_within

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_LAYER_NORM_EPS = 1e-6

def _block_order(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each of an image's ``t * h * w`` patches, in the processor's
    merge-block order, every frame alike."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    cols = cols.reshape(blocks).transpose(1, 2).flatten()
    return rows.repeat(t), cols.repeat(t)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two entries of a ``side``-long axis that position ``index`` of a ``size``-long
    one reads, and their weights: bilinear with aligned corners (both ends map to the
    table's ends), as ``F.interpolate(align_corners=True)``."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = source.floor()
    fraction = (source - floor)[:, None]
    taps = (floor.long()[:, None] + torch.arange(2)).clamp(max=side - 1)  # (N, 2)
    return taps, torch.cat([1 - fraction, fraction], dim=1)


class Qwen3VLVisionAttention(nn.Module):
    """Bidirectional attention within each frame, on this rank's heads."""

    def __init__(self, hidden_size: int, num_heads: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.qkv = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_heads,
                                     bias=True, tp_group=tp_group,
                                     quantization=quantization_for_inputs(quantization,
                                                                          hidden_size))
        self.num_heads = self.qkv.num_heads
        self.proj = RowParallelLinear(hidden_size, hidden_size, bias=True, tp_group=tp_group,
                                      quantization=quantization_for_inputs(
                                          quantization, hidden_size // tp_group.world_size))

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frame_lengths: list[int]) -> torch.Tensor:
        num_patches = hidden_states.shape[0]
        qkv = self.qkv(hidden_states).view(num_patches, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # (N, H, D) each; cos, sin: (N, 1, D)
        return self.proj(rope_attention_within(q, k, v, cos, sin, frame_lengths))


class Qwen3VLVisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {hidden_act!r} is not supported; only "
                             f"{', '.join(_ACTIVATIONS)}")
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size, intermediate_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization, hidden_size))
        self.linear_fc2 = RowParallelLinear(
            intermediate_size, hidden_size, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization,
                                                 intermediate_size // tp_group.world_size))
        self.act_fn = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, vision_config: Any, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        hidden_size = vision_config.hidden_size
        self.norm1 = nn.LayerNorm(hidden_size, eps=_LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(hidden_size, eps=_LAYER_NORM_EPS)
        self.attn = Qwen3VLVisionAttention(hidden_size, vision_config.num_heads, tp_group,
                                           quantization)
        self.mlp = Qwen3VLVisionMLP(hidden_size, vision_config.intermediate_size,
                                    vision_config.hidden_act, tp_group, quantization)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frame_lengths: list[int]) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cos, sin,
                                                  frame_lengths)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class Qwen3VLPatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches, concatenated, to one language-model row
    through a GELU MLP. The main merger normalizes each patch before the concatenation,
    a deepstack merger (``norm_after_concat``) the concatenated block."""

    def __init__(self, vision_config: Any, norm_after_concat: bool, tp_group: TPGroup) -> None:
        super().__init__()
        self.block_size = vision_config.hidden_size * vision_config.spatial_merge_size ** 2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.block_size if norm_after_concat
                                 else vision_config.hidden_size, eps=_LAYER_NORM_EPS)
        self.linear_fc1 = ColumnParallelLinear(self.block_size, self.block_size, bias=True,
                                               tp_group=tp_group)
        self.linear_fc2 = RowParallelLinear(self.block_size, vision_config.out_hidden_size,
                                            bias=True, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.norm_after_concat:
            blocks = self.norm(hidden_states.view(-1, self.block_size))
        else:
            blocks = self.norm(hidden_states).view(-1, self.block_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(blocks)))


class Qwen3VLVisionTower(nn.Module):
    """Pixels of a batch of images (or video frames) to their placeholder tokens' rows:
    the main merger's, then each deepstack level's, concatenated (the module
    docstring). An image of grid ``(t, h, w)`` patches gives
    ``t * h * w / spatial_merge_size ** 2`` rows, images in the batch's order."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        """``quantization``: what the blocks' linear layers hold (``--quantization``'s
        wint8 or wint4, as the decoder's); the patch embedding and mergers stay in the
        model's dtype."""
        super().__init__()
        vision_config = config.vision_config
        if not isinstance(vision_config.patch_size, int) \
                or not isinstance(vision_config.temporal_patch_size, int):
            raise TypeError("Qwen3-VL vision patch_size and temporal_patch_size must be "
                            f"integers, got {vision_config.patch_size!r} and "
                            f"{vision_config.temporal_patch_size!r}")
        self.merge_size = vision_config.spatial_merge_size
        self.out_hidden_size = vision_config.out_hidden_size
        self.deepstack_visual_indexes = list(vision_config.deepstack_visual_indexes)
        hidden_size = vision_config.hidden_size
        patch_values = (vision_config.in_channels * vision_config.temporal_patch_size
                        * vision_config.patch_size ** 2)
        self.patch_embed = ReplicatedLinear(patch_values, hidden_size, bias=True)
        self.pos_embed = nn.Embedding(vision_config.num_position_embeddings, hidden_size)
        self.grid_side = int(vision_config.num_position_embeddings ** 0.5)
        if self.grid_side ** 2 != vision_config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {vision_config.num_position_embeddings}"
                             " is not a square; Qwen3-VL's position embeddings are a square grid")
        head_dim = hidden_size // vision_config.num_heads
        theta = rope_parameters(vision_config)["rope_theta"]
        # a quarter of the head's frequencies per axis: rows, then columns, twice
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)),
            persistent=False)
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(vision_config, tp_group, quantization)
                                    for _ in range(vision_config.depth))
        self.merger = Qwen3VLPatchMerger(vision_config, norm_after_concat=False,
                                         tp_group=tp_group)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(vision_config, norm_after_concat=True, tp_group=tp_group)
            for _ in self.deepstack_visual_indexes)

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``pixel_values`` (num_patches, C * T * P * P), ``grid_thw`` (num_images, 3)
        int64 -> (num_tokens, out_hidden_size * (1 + num_deepstack_levels))."""
        if grid_thw is None:
            raise ValueError("Qwen3-VL needs image_grid_thw beside pixel_values")
        grids = [tuple(grid) for grid in grid_thw.tolist()]
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grids} holds a different number of patches "
                             f"than pixel_values' {pixel_values.shape[0]} rows")
        # images in passes of at most PASS_ROWS patches (one larger image alone); each
        # pass's rows are | main | deepstack 0 | ... |, in image order
        return in_passes(self._pass, pixel_values, grids, [t * h * w for t, h, w in grids])

    def _pass(self, pixel_values: torch.Tensor,
              grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``forward`` over images that go through the blocks together."""
        dtype = self.pos_embed.weight.dtype
        hidden_states = self.patch_embed(pixel_values.to(dtype))  # (N, hidden)
        rows, cols = (torch.cat(axis) for axis in
                      zip(*(_block_order(t, h, w, self.merge_size) for t, h, w in grids)))
        hidden_states = hidden_states + self._position_embeddings(rows, cols, grids)
        cos, sin = self._rope(rows, cols, hidden_states.device)
        frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
        levels = []
        for index, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, cos, sin, frame_lengths)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                levels.append(merger(hidden_states))
        return torch.cat([self.merger(hidden_states), *levels], dim=-1)

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor,
                             grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The square table resampled bilinearly to each image's grid, at each patch:
        the four nearest entries, weighted. (N, hidden)"""
        taps, weights = [], []
        start = 0
        for t, h, w in grids:
            end = start + t * h * w
            row_taps, row_weights = _bilinear_taps(rows[start:end], h, self.grid_side)
            col_taps, col_weights = _bilinear_taps(cols[start:end], w, self.grid_side)
            taps.append((row_taps[:, :, None] * self.grid_side + col_taps[:, None, :]).flatten(1))
            weights.append((row_weights[:, :, None] * col_weights[:, None, :]).flatten(1))
            start = end
        device = self.pos_embed.weight.device
        taps, weights = torch.cat(taps).to(device), torch.cat(weights).to(device)  # (N, 4)
        embeddings = (self.pos_embed(taps) * weights[:, :, None]).sum(1)
        return embeddings.to(self.pos_embed.weight.dtype)

    def _rope(self, rows: torch.Tensor, cols: torch.Tensor,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, 1, head_dim), float32: per head, ``| rows | cols | rows | cols |``."""
        inv_freq = self.inv_freq.to(device)
        angles = torch.cat([rows.to(device)[:, None] * inv_freq,
                            cols.to(device)[:, None] * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named below ``model.visual.`` into this rank's shards; the
        fused ``attn.qkv`` splits into its q, k, v thirds, the patch embedding's Conv3d
        weight (hidden, C, T, P, P) flattens to the linear's (hidden, C * T * P * P)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("patch_embed.proj."):
                name = name.replace("patch_embed.proj.", "patch_embed.")
                tensor = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is the vision config right?")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if ".attn.qkv." in name:
                for shard_id, third in zip("qkv", tensor.chunk(3, dim=0)):
                    weight_loader(param, third, shard_id)
            else:
                weight_loader(param, tensor)
            loaded.add(name)
        return loaded
