"""PaddleOCR-VL's vision tower: a NaViT-style SigLIP encoder and the projector
(``mlp_AR``) that merges its patches into language-model rows, tensor parallel.

Pixels arrive as the image processor made them (``PaddleOCRVLImageProcessor``): one
(C, P, P) patch per row, each image's patches in raster order over its own grid:

    grid h=4, w=4 -> rows (row, col): (0,0) (0,1) (0,2) (0,3) (1,0) ... (3,3)

    patches (N, C, P, P)
      -> patch_embedding + position_embedding   the conv as a linear over a patch; the
                                                learned square grid of positions
                                                resampled bilinearly to the image's grid
                                                (half-pixel centres, align_corners=False)
      -> encoder layers (pre-LayerNorm, 2D rope: rows rotate one quarter of each head's
         frequencies' pairs and columns another, bidirectional attention within an
         image, GELU-tanh MLP), post_layernorm  (N, D)
      -> projector: LayerNorm per patch, each 2x2 block of the raster grid concatenated
         (its patches row by row), linear, GELU, linear
                                                (N / 4, text hidden_size)

Rows come out image by image, each image's blocks in raster order over the merged grid:
the order of the prompt's placeholder tokens. Attention heads, the MLP's hidden features
and the projector's are split over the tensor-parallel ranks; the patch embedding is
replicated.

Checkpoint names relative to the tower: ``vision_model.<x>`` (the checkpoint's
``visual.vision_model.<x>``; transformers 5 in memory ``model.visual.vision_model.<x>``)
and ``projector.<y>`` (the checkpoint's ``mlp_AR.<y>``, in memory ``model.projector.``).
q_proj, k_proj and v_proj load into one fused qkv_proj; the patch embedding's conv
weight (D, C, P, P) flattens to (D, C * P * P). The published checkpoint's
``packing_position_embedding`` and pooling ``head`` are unused, as in transformers.
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
from loom.model.vision.gemma3 import SiglipMLP

_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
           "v_proj": ("qkv_proj", "v")}
# in the published checkpoint, used by neither transformers nor loom
_UNUSED = ("vision_model.embeddings.packing_position_embedding.", "vision_model.head.")
_PROJECTOR_NORM_EPS = 1e-5  # transformers' PaddleOCRProjector, whatever the config says


def _raster_order(t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each of an image's ``t * h * w`` patches, raster order, every
    frame alike."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return rows.flatten().repeat(t), cols.flatten().repeat(t)


def _bilinear_taps(index: torch.Tensor, size: int, side: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two entries of a ``side``-long axis that position ``index`` of a ``size``-long
    one reads, and their weights: bilinear on half-pixel centres (``F.interpolate``'s
    ``align_corners=False``), taps past either end clamped to it. (N, 2) each."""
    source = (index.float() + 0.5) * side / size - 0.5
    floor = source.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class PaddleOCRVisionAttention(nn.Module):
    """Bidirectional attention within each image, on this rank's heads."""

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

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                image_lengths: list[int]) -> torch.Tensor:
        num_patches = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states).view(num_patches, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # (N, H, D) each; cos, sin: (N, 1, D)
        return self.out_proj(rope_attention_within(q, k, v, cos, sin, image_lengths))


class PaddleOCRVisionEncoderLayer(nn.Module):
    def __init__(self, vision: Any, tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.self_attn = PaddleOCRVisionAttention(vision.hidden_size,
                                                  vision.num_attention_heads, tp_group,
                                                  quantization)
        self.layer_norm2 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.mlp = SiglipMLP(vision.hidden_size, vision.intermediate_size, tp_group,
                             quantization)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                image_lengths: list[int]) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states),
                                                       cos, sin, image_lengths)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class PaddleOCRVisionModel(nn.Module):
    """The SigLIP encoder over a batch of variable-size images: patches in, the
    post-LayerNorm'd hidden states out, (N, D)."""

    def __init__(self, vision: Any, tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        if vision.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {vision.hidden_act!r} is not supported; "
                             "PaddleOCR-VL's SigLIP uses gelu_pytorch_tanh")
        self.grid_side = vision.image_size // vision.patch_size
        hidden_size = vision.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = ReplicatedLinear(
            vision.num_channels * vision.patch_size ** 2, hidden_size, bias=True)
        self.embeddings.position_embedding = nn.Embedding(self.grid_side ** 2, hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(PaddleOCRVisionEncoderLayer(vision, tp_group,
                                                                        quantization)
                                            for _ in range(vision.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(hidden_size, eps=vision.layer_norm_eps)
        head_dim = hidden_size // vision.num_attention_heads
        theta = rope_parameters(vision)["rope_theta"]
        # a quarter of the head's frequencies per axis: rows, then columns, twice
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)),
            persistent=False)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """``pixel_values`` (N, C, P, P), ``grids`` each image's (t, h, w) -> (N, D)."""
        table = self.embeddings.position_embedding.weight
        patches = pixel_values.to(table.dtype).flatten(1)  # (N, C * P * P)
        hidden_states = self.embeddings.patch_embedding(patches)
        rows, cols = (torch.cat(axis) for axis in
                      zip(*(_raster_order(t, h, w) for t, h, w in grids)))
        hidden_states = hidden_states + self._position_embeddings(rows, cols, grids)
        cos, sin = self._rope(rows, cols, hidden_states.device)
        image_lengths = [h * w for t, h, w in grids for _ in range(t)]
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states, cos, sin, image_lengths)
        return self.post_layernorm(hidden_states)

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor,
                             grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The square table resampled bilinearly to each image's grid, at each patch:
        the four nearest entries, weighted. (N, D)"""
        taps, weights = [], []
        start = 0
        for t, h, w in grids:
            end = start + t * h * w
            row_taps, row_weights = _bilinear_taps(rows[start:end], h, self.grid_side)
            col_taps, col_weights = _bilinear_taps(cols[start:end], w, self.grid_side)
            taps.append((row_taps[:, :, None] * self.grid_side + col_taps[:, None, :]).flatten(1))
            weights.append((row_weights[:, :, None] * col_weights[:, None, :]).flatten(1))
            start = end
        table = self.embeddings.position_embedding
        taps = torch.cat(taps).to(table.weight.device)  # (N, 4)
        weights = torch.cat(weights).to(table.weight.device)
        return (table(taps) * weights[:, :, None]).sum(1).to(table.weight.dtype)

    def _rope(self, rows: torch.Tensor, cols: torch.Tensor,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, 1, head_dim), float32: per head, ``| rows | cols | rows | cols |``."""
        inv_freq = self.inv_freq.to(device)
        angles = torch.cat([rows.to(device)[:, None] * inv_freq,
                            cols.to(device)[:, None] * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()


class PaddleOCRProjector(nn.Module):
    """Each image's ``merge x merge`` blocks of patches (LayerNorm'd, concatenated) to
    language-model rows through a GELU MLP."""

    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__()
        vision = config.vision_config
        self.merge = vision.spatial_merge_size
        block_size = vision.hidden_size * self.merge ** 2
        self.pre_norm = nn.LayerNorm(vision.hidden_size, eps=_PROJECTOR_NORM_EPS)
        self.linear_1 = ColumnParallelLinear(block_size, block_size, bias=True,
                                             tp_group=tp_group)
        self.linear_2 = RowParallelLinear(block_size, config.text_config.hidden_size,
                                          bias=True, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """(N, D) raster-order patches -> (N / merge ** 2, text hidden_size)."""
        m = self.merge
        hidden_states = self.pre_norm(hidden_states)
        blocks = []
        for (t, h, w), image in zip(grids, hidden_states.split([t * h * w for t, h, w in grids])):
            # (t, h/m, m, w/m, m, D) -> (t, h/m, w/m, m, m, D): a block's patches together
            image = image.view(t, h // m, m, w // m, m, -1).transpose(2, 3)
            blocks.append(image.reshape(t * (h // m) * (w // m), -1))
        return self.linear_2(F.gelu(self.linear_1(torch.cat(blocks))))


class PaddleOCRVisionTower(nn.Module):
    """Pixels of a batch of images to their placeholder tokens' rows (the module
    docstring). An image of grid ``(t, h, w)`` patches gives
    ``t * h * w / spatial_merge_size ** 2`` rows, images in the batch's order."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        super().__init__()
        self.merge = config.vision_config.spatial_merge_size
        self.vision_model = PaddleOCRVisionModel(config.vision_config, tp_group, quantization)
        self.projector = PaddleOCRProjector(config, tp_group)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``pixel_values`` (num_patches, C, P, P), ``grid_thw`` (num_images, 3) int64
        -> (num_tokens, text hidden_size)."""
        if grid_thw is None:
            raise ValueError("PaddleOCR-VL needs image_grid_thw beside pixel_values")
        grids = [tuple(grid) for grid in grid_thw.tolist()]
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grids} holds a different number of patches "
                             f"than pixel_values' {pixel_values.shape[0]} rows")
        if any(h % self.merge or w % self.merge for _, h, w in grids):
            raise ValueError(f"image grids {grids} are not whole blocks of "
                             f"{self.merge}x{self.merge} patches; preprocess the images "
                             "with the checkpoint's own image processor")
        return in_passes(lambda pixels, grids: self.projector(
            self.vision_model(pixels, grids), grids), pixel_values, grids,
            [t * h * w for t, h, w in grids])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named ``vision_model.*`` and ``projector.*`` (the module docstring)
        into this rank's shards."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(_UNUSED):
                continue
            if name == "vision_model.embeddings.patch_embedding.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            for ckpt_name, (packed_name, packed_shard) in _PACKED.items():
                if f".{ckpt_name}." in name:
                    name = name.replace(f".{ckpt_name}.", f".{packed_name}.")
                    shard_id = packed_shard
                    break
            else:
                shard_id = None
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is the vision config right?")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, tensor, shard_id)
            loaded.add(name)
        return loaded
