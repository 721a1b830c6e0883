"""SmolVLM's vision tower: a SigLIP encoder over each tile of an image, and the connector
(pixel shuffle and the modality projection).

SmolVLM's image processor splits an image into a grid of tiles beside a global view of
it, each a square of ``max_image_size`` pixels; every tile is an image to the tower:

    pixel_values (N, 3, S, S), a mask of its real pixels (N, S, S)   N tiles, p = patch
      -> drop the tiles that are all zeros (padding of a batch)       G = S // p
      -> patches (N * G * G, 3 * p * p), row-major over the grid      the conv as a linear
      -> patch_embedding + position_embedding at each patch's bucket of the
         vision config's image_size // p grid (NaViT: a tile with padded patches
         spreads its real ones over the whole table)
      -> encoder layers (pre-LayerNorm, attention within a tile over its real
         patches, GELU-tanh MLP), post_layernorm                      (N, G * G, D)
      -> pixel shuffle: each s x s block of patches into one row      (N, G * G / s², D s²)
      -> modality projection to the text size                         (N * G * G / s², text hidden)

Attention heads and the MLP's hidden features are split over the tensor-parallel ranks;
the patch embedding and the projection are replicated.

Checkpoint names, relative to ``model.``: ``vision_model.<x>`` and
``connector.modality_projection.proj.weight``. ``load_weights`` fuses q_proj, k_proj,
v_proj into qkv_proj and flattens the patch embedding's conv weight (D, 3, p, p) to
(D, 3 * p * p), the order ``_patches`` flattens a patch in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.linear import ReplicatedLinear, default_weight_loader
from loom.model.vision.gemma3 import SiglipVisionModel, siglip_tensor

class SmolVLMVisionModel(SiglipVisionModel):
    """SigLIP's encoder over tiles of any size (a multiple of the patch): patches in, the
    post-LayerNorm'd last hidden state out. The position table is the vision config's
    ``image_size // patch_size`` grid, over which each tile's real patches spread."""

    def _patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N * Gh * Gw, C * p * p): patch (row, col) at row
        ``row * Gw + col`` of its tile, each flattened as (channel, y, x), the order of
        the conv weight's (C, p, p); pixels past the last whole patch dropped, as the
        conv drops them."""
        num_tiles, channels, height, width = pixel_values.shape
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = pixel_values[:, :, :rows * p, :cols * p].reshape(
            num_tiles, channels, rows, p, cols, p)
        return patches.permute(0, 2, 4, 1, 3, 5).reshape(num_tiles * rows * cols, -1)

    def _position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """(N, Gh, Gw) real patches -> (N, Gh * Gw) rows of the position table: a tile's
        real patches spread over the table's grid by their fraction of the tile's real
        rows and columns (bucketed as transformers does, in float32), padding at 0."""
        num_tiles, rows, cols = patch_mask.shape
        device = patch_mask.device
        side = self.grid_size
        boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32, device=device)
        real_rows = patch_mask[:, :, 0].sum(dim=1).to(torch.float32)  # (N,)
        real_cols = patch_mask[:, 0, :].sum(dim=1).to(torch.float32)
        fraction_h = torch.arange(rows, dtype=torch.float32, device=device)[None, :] \
            * (1.0 / real_rows)[:, None]  # (N, Gh)
        fraction_w = torch.arange(cols, dtype=torch.float32, device=device)[None, :] \
            * (1.0 / real_cols)[:, None]  # (N, Gw)
        bucket_h = torch.bucketize(fraction_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(fraction_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
        position_ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(num_tiles, -1)
        return torch.where(patch_mask.reshape(num_tiles, -1), position_ids, 0)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` (N, C, H, W), ``patch_mask`` (N, H // p, W // p) bool, the
        patches holding a real pixel -> (N, H // p * W // p, D)."""
        num_tiles = pixel_values.shape[0]
        position_table = self.embeddings.position_embedding.weight
        patches = self._patches(pixel_values.to(position_table.dtype))
        hidden_states = self.embeddings.patch_embedding(patches).view(num_tiles, -1,
                                                                      position_table.shape[1])
        hidden_states = hidden_states + position_table[self._position_ids(patch_mask)]
        key_mask = patch_mask.reshape(num_tiles, -1)
        key_mask = None if bool(key_mask.all()) else key_mask
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states, key_mask)
        return self.post_layernorm(hidden_states)


class SmolVLMConnector(nn.Module):
    """The encoder's (N, G * G, D) tiles to (N * G * G / s², text hidden_size) rows: each
    s x s block of patches concatenated into one row, then projected."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = ReplicatedLinear(
            config.vision_config.hidden_size * self.scale_factor ** 2,
            config.text_config.hidden_size, bias=False)

    def pixel_shuffle(self, tiles: torch.Tensor) -> torch.Tensor:
        """(N, G * G, D) -> (N, G * G / s², D * s²), as transformers' pixel_shuffle: row
        (i, j) of the (G/s, G/s) output grid holds patches (s*i + a, s*j + b) for
        a, b < s, ordered a-major (its rows, then its columns), each D wide."""
        num_tiles, num_patches, dim = tiles.shape
        side, s = int(num_patches ** 0.5), self.scale_factor
        if side * side != num_patches or side % s:
            raise ValueError(f"a tile of {num_patches} patches is not a square grid whose "
                             f"side divides by the scale factor {s}; preprocess the images "
                             "with the checkpoint's own image processor")
        x = tiles.view(num_tiles, side, side // s, dim * s)  # columns in pairs
        x = x.permute(0, 2, 1, 3).reshape(num_tiles, side // s, side // s, dim * s * s)
        return x.permute(0, 2, 1, 3).reshape(num_tiles, num_patches // (s * s), dim * s * s)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        shuffled = self.pixel_shuffle(tiles)
        return self.modality_projection.proj(shuffled.flatten(0, 1))


class SmolVLMVisionTower(nn.Module):
    """Pixels of an image's tiles to the rows that replace its ``<image>`` tokens: per
    tile, ``image_seq_len`` rows of the text hidden size, tile by tile (the grid
    row-major, then the global view)."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        super().__init__()
        vision = config.vision_config
        self.patch_size = vision.patch_size
        self.image_seq_len = (vision.image_size // vision.patch_size) ** 2 \
            // config.scale_factor ** 2
        self.vision_model = SmolVLMVisionModel(vision, tp_group, quantization)
        self.connector = SmolVLMConnector(config)

    def forward(self, pixel_values: torch.Tensor,
                pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``pixel_values`` (N, 3, S, S) or a batch's (B, N, 3, S, S) from SmolVLM's image
        processor, ``pixel_attention_mask`` its (N, S, S) or (B, N, S, S) mask of real
        pixels (None: all are) -> (real tiles * rows per tile, text hidden_size), in the
        model's dtype. As transformers does, tiles whose pixels are all zero are padding
        and make no rows (but the first tile where none is real)."""
        pixel_values = pixel_values.reshape(-1, *pixel_values.shape[-3:])
        if pixel_attention_mask is None:
            pixel_attention_mask = torch.ones(
                (pixel_values.shape[0], *pixel_values.shape[-2:]), dtype=torch.bool,
                device=pixel_values.device)
        pixel_attention_mask = pixel_attention_mask.reshape(-1, *pixel_values.shape[-2:])
        real = (pixel_values != 0).flatten(1).any(dim=1)  # (N,)
        real[0] |= ~real.any()
        pixel_values, pixel_attention_mask = pixel_values[real], pixel_attention_mask[real]
        # a patch is real where it holds a real pixel
        num_tiles, height, width = pixel_attention_mask.shape
        p = self.patch_size
        patch_mask = (pixel_attention_mask[:, :height // p * p, :width // p * p] != 0).reshape(
            num_tiles, height // p, p, width // p, p).any(dim=4).any(dim=2)
        return self.connector(self.vision_model(pixel_values, patch_mask))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named relative to ``model.`` (``vision_model.…``,
        ``connector.…``) into this rank's shards; returns the names of the parameters
        loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name, tensor, shard_id = siglip_tensor(name, tensor)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is it a SmolVLM vision tower's?")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        return loaded
