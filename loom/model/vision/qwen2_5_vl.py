"""Qwen2.5-VL's vision tower: image patches in, one row per image placeholder token out.

A ViT over 14-pixel patches (a Conv3d over 2 frames, here one matmul over each flattened
patch), with a 2D rope on each patch's (row, column); RMSNorm blocks with a gated SiLU
MLP; most blocks attend within square windows of ``window_size`` pixels, the blocks of
``fullatt_block_indexes`` over the whole frame. The merger then fuses each
``spatial_merge_size`` x ``spatial_merge_size`` square of patches into one row of the
language model's hidden size: ``t * h * w / spatial_merge_size**2`` rows per image of
``image_grid_thw`` ``(t, h, w)``.

Heads, the MLP and the merger's MLP are split over the tensor-parallel ranks (qkv and
gate_up column parallel, proj and down row parallel); the patch embedding is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.activation import SiluAndMul
from loom.model.layers.layernorm import RMSNorm, residual_stream
from loom.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    quantization_for_inputs,
)
from loom.model.vision import in_passes, native_attention_within

_NORM_EPS = 1e-6  # every norm of the tower (not in the config)


@dataclass(frozen=True)
class _Segments:
    """Contiguous spans of rows that attend only among themselves (a window, a frame),
    grouped by length so that equal spans run as one batched attention: lengths
    [4, 4, 2] -> groups [[0..3], [4..7]] (2, 4) and [[8, 9]] (1, 2). A group whose
    spans follow one another (every window of an image whose side is a whole number of
    windows, every frame of equal images) is also ``runs``' (first row, spans, length),
    which attention reads as a view rather than a gather."""

    groups: tuple[torch.Tensor, ...]  # each (num_spans, span_length): the spans' rows
    runs: tuple[tuple[int, int, int] | None, ...]  # per group, or None
    lengths: torch.Tensor  # (spans,) int64 on the CPU: every span's, in row order

    @classmethod
    def of_lengths(cls, lengths: list[int], device: torch.device) -> _Segments:
        starts_by_length: dict[int, list[int]] = {}
        start = 0
        for length in lengths:
            starts_by_length.setdefault(length, []).append(start)
            start += length
        runs = tuple((starts[0], len(starts), length)
                     if starts == list(range(starts[0], starts[0] + len(starts) * length,
                                             length)) else None
                     for length, starts in starts_by_length.items())
        return cls(tuple(torch.tensor(starts, device=device)[:, None]
                         + torch.arange(length, device=device)
                         for length, starts in starts_by_length.items()), runs,
                   torch.tensor(lengths, dtype=torch.int64))


@dataclass(frozen=True)
class _WindowLayout:
    """The order the tower runs one batch's patch rows in, and each row's (h, w).

    The image processor hands each frame's patches merge unit by merge unit (the
    ``spatial_merge_size**2`` patches the merger fuses are adjacent rows), units in
    raster order. The tower runs the rows window by window, each window's units in
    raster order, so that every window (and every frame, which windows never cross) is
    a contiguous span; the merger's rows are put back in the processor's order at the
    end. A 4 x 6 patch frame (56 x 84 pixels), merge 2, windows of 2 x 2 units:

        units  0 1 2    windows  | 0 1 | 2 |   unit order [0, 1, 3, 4, 2, 5]
               3 4 5             | 3 4 | 5 |   window lengths [4, 2] units = [16, 8] rows
    """

    patch_order: torch.Tensor  # (N,) the processor's row of each row the tower runs
    unit_order: torch.Tensor  # (N / merge**2,) the processor's unit of each merged row
    positions: torch.Tensor  # (N, 2) each row's patch (row, column) in its frame
    windows: _Segments
    frames: _Segments

    @classmethod
    def of_grids(cls, grid_thw: torch.Tensor, merge: int, window_units: int,
                 device: torch.device) -> _WindowLayout:
        """``grid_thw``: (num_images, 3) patches per image along t, h, w;
        ``window_units``: a window's side in merge units."""
        unit_size = merge * merge
        in_unit = torch.arange(unit_size)
        unit_orders, positions = [], []
        window_lengths: list[int] = []
        frame_lengths: list[int] = []
        first_unit = 0
        for t, h, w in grid_thw.tolist():
            rows, cols = h // merge, w // merge  # merge units of a frame
            units = torch.arange(t * rows * cols).view(t, rows, cols)
            num_h, num_w = math.ceil(rows / window_units), math.ceil(cols / window_units)
            padded = F.pad(units, (0, num_w * window_units - cols,
                                   0, num_h * window_units - rows), value=-1)
            windows = padded.view(t, num_h, window_units, num_w, window_units) \
                .transpose(2, 3).reshape(-1, window_units * window_units)  # (windows, units)
            kept = windows >= 0
            order = windows[kept]
            window_lengths += (kept.sum(1) * unit_size).tolist()
            frame_lengths += [h * w] * t
            in_frame = order % (rows * cols)
            patch_h = (in_frame // cols)[:, None] * merge + in_unit // merge
            patch_w = (in_frame % cols)[:, None] * merge + in_unit % merge
            positions.append(torch.stack([patch_h.flatten(), patch_w.flatten()], dim=-1))
            unit_orders.append(order + first_unit)
            first_unit += t * rows * cols
        unit_order = torch.cat(unit_orders)
        patch_order = (unit_order[:, None] * unit_size + in_unit).flatten()
        return cls(patch_order.to(device), unit_order.to(device),
                   torch.cat(positions).to(device),
                   _Segments.of_lengths(window_lengths, device),
                   _Segments.of_lengths(frame_lengths, device))


# rows the rope rotates at a time: its float32 temporaries stay in cache and under
# glibc's 32 MiB mmap threshold. Over 8 images' rows at once (8,192) each was a fresh
# mapping, page-faulted in every block: a 1B tower's rope took 0.62 s an image, against
# 0.11 s for one image alone (one core)
_ROPE_ROWS = 512


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rope on ``x`` (N, heads, D) in float32, rounded once to x's dtype:
    ``[x1 * cos - x2 * sin | x2 * cos + x1 * sin]``, cos and sin (N, 1, D / 2) float32.
    Each product is float32 (x's halves promote exactly), each sum rounded as it is
    stored into the result; ``_ROPE_ROWS`` rows at a time."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], _ROPE_ROWS):
        rows = slice(start, start + _ROPE_ROWS)
        x1, x2 = x[rows, :, :half], x[rows, :, half:]
        c, s = cos[rows], sin[rows]
        torch.sub(x1 * c, x2 * s, out=out[rows, :, :half])
        torch.add(x2 * c, x1 * s, out=out[rows, :, half:])
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            segments: _Segments) -> torch.Tensor:
    """Bidirectional attention within each segment; q, k, v (N, H, D), which may be
    strided views of the fused qkv, and the result (N, H, D)."""
    num_rows, num_heads, head_dim = q.shape
    out = native_attention_within(q, k, v, segments.lengths)  # bf16 on the CPU
    if out is not None:
        return out
    for rows, run in zip(segments.groups, segments.runs):  # (B, L)
        if run is not None:
            first, num_spans, length = run
            span = slice(first, first + num_spans * length)
            # (B, L, H, D) views -> (B, H, L, D), no copy
            span_q, span_k, span_v = (x[span].view(num_spans, length, num_heads, head_dim)
                                      .transpose(1, 2) for x in (q, k, v))
        else:
            span_q, span_k, span_v = (x[rows].transpose(1, 2) for x in (q, k, v))
        result = F.scaled_dot_product_attention(span_q, span_k, span_v).transpose(1, 2)
        if run is not None and num_spans * length == num_rows:  # one group: every row
            return result.reshape(num_rows, num_heads, head_dim)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if run is not None:
            out[span].view(num_spans, length, num_heads, head_dim).copy_(result)
        else:
            out[rows] = result
    return out


class _PatchEmbed(nn.Module):
    """The checkpoint's Conv3d, whose stride is its kernel: one matmul over each patch
    row (C * T * P * P features, as the processor flattens them), replicated."""

    def __init__(self, patch_features: int, hidden_size: int) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(patch_features, hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class _VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        # the checkpoint's fused qkv rows are | q | k | v |, each num_heads * head_dim
        self.qkv = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_heads,
                                     bias=True, tp_group=tp_group,
                                     quantization=quantization_for_inputs(quantization,
                                                                          hidden_size))
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(hidden_size, hidden_size, bias=True,
                                      tp_group=tp_group, float_output=True,
                                      quantization=quantization_for_inputs(
                                          quantization, hidden_size // tp_group.world_size))

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                segments: _Segments) -> torch.Tensor:
        num_rows = hidden_states.shape[0]
        qkv = self.qkv(hidden_states).view(num_rows, 3 * self.num_heads, self.head_dim)
        qk = _rotate(qkv[:, :2 * self.num_heads], *rope)  # (N, 2H, D)
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, 2 * self.num_heads:]
        return self.proj(_attend(q, k, v, segments).reshape(num_rows, -1))


class _VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_group: TPGroup,
                 quantization: str = "none") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=True, tp_group=tp_group,
            quantization=quantization_for_inputs(quantization, hidden_size))
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=True, tp_group=tp_group, float_output=True,
            quantization=quantization_for_inputs(quantization,
                                                 intermediate_size // tp_group.world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class _VisionBlock(nn.Module):
    """Pre-norm attention and MLP; like loom's decoder layers it hands back its MLP's
    float32 output and the float32 residual stream, which the next norm adds."""

    def __init__(self, vision: Any, tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        self.norm1 = RMSNorm(vision.hidden_size, eps=_NORM_EPS)
        self.norm2 = RMSNorm(vision.hidden_size, eps=_NORM_EPS)
        self.attn = _VisionAttention(vision.hidden_size, vision.num_heads, tp_group,
                                     quantization)
        self.mlp = _VisionMLP(vision.hidden_size, vision.intermediate_size, tp_group,
                              quantization)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor],
                segments: _Segments) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = residual_stream(hidden_states)
            hidden_states = self.norm1(hidden_states)
        else:
            hidden_states, residual = self.norm1(hidden_states, residual)
        hidden_states = self.attn(hidden_states, rope, segments)
        hidden_states, residual = self.norm2(hidden_states, residual)
        return self.mlp(hidden_states), residual


class _PatchMerger(nn.Module):
    """The last block's output, normed, each merge unit's rows concatenated into one and
    projected to the language model's hidden size by a GELU MLP."""

    def __init__(self, hidden_size: int, out_hidden_size: int, merge: int,
                 tp_group: TPGroup) -> None:
        super().__init__()
        self.merged_size = hidden_size * merge * merge
        self.ln_q = RMSNorm(hidden_size, eps=_NORM_EPS)
        # named as the checkpoint's nn.Sequential: mlp.0 and mlp.2
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.merged_size, self.merged_size, bias=True,
                                 tp_group=tp_group),
            nn.GELU(),
            RowParallelLinear(self.merged_size, out_hidden_size, bias=True, tp_group=tp_group))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden_states, _ = self.ln_q(hidden_states, residual)
        return self.mlp(hidden_states.reshape(-1, self.merged_size))


class Qwen2_5_VLVisionTower(nn.Module):
    """``forward(pixel_values, grid_thw)`` -> (sum of t * h * w / merge**2 over the
    images, ``vision_config.out_hidden_size``): the rows of the images' placeholder
    tokens, image by image, each image's in the processor's (merge unit) order."""

    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 quantization: str = "none") -> None:
        """``quantization``: what the blocks' linear layers hold (``--quantization``'s
        wint8 or wint4, as the decoder's); the patch embedding and merger stay in the
        model's dtype."""
        super().__init__()
        vision = config.vision_config
        if vision.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {vision.hidden_act!r} is not "
                             "supported; Qwen2.5-VL's vision tower uses silu")
        self.spatial_merge_size = vision.spatial_merge_size
        self.head_dim = vision.hidden_size // vision.num_heads
        # a window's side in merge units (112 pixels, patch 14, merge 2: 4)
        self.window_units = vision.window_size // vision.spatial_merge_size // vision.patch_size
        if self.window_units < 1:
            raise ValueError(f"vision_config.window_size {vision.window_size} is smaller than "
                             "one merge unit of patches")
        self.fullatt_block_indexes = frozenset(vision.fullatt_block_indexes)
        self.rope_theta = float((getattr(vision, "rope_parameters", None) or {})
                                .get("rope_theta", 10000.0))
        patch_features = (vision.in_channels * vision.temporal_patch_size
                          * vision.patch_size * vision.patch_size)
        self.patch_embed = _PatchEmbed(patch_features, vision.hidden_size)
        self.blocks = nn.ModuleList(_VisionBlock(vision, tp_group, quantization)
                                    for _ in range(vision.depth))
        self.merger = _PatchMerger(vision.hidden_size, vision.out_hidden_size,
                                   vision.spatial_merge_size, tp_group)

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, 1, D / 2) of each row's angles: its patch row times the
        D / 4 frequencies, then its patch column times the same ones."""
        spatial_dim = self.head_dim // 2
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, spatial_dim, 2, dtype=torch.float32, device=positions.device)
            / spatial_dim)
        angles = (positions[..., None].float() * inv_freq).flatten(1)  # (N, D / 2)
        return angles.cos()[:, None], angles.sin()[:, None]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``pixel_values`` (N, C * T * P * P) and ``grid_thw`` (num_images, 3) as the
        image processor made them."""
        if grid_thw is None:
            raise ValueError("Qwen2.5-VL's vision tower needs image_grid_thw from its "
                             "image processor")
        patches = grid_thw.prod(-1).tolist()
        if sum(patches) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grid_thw.tolist()} makes {sum(patches)} "
                             f"patches but pixel_values has {pixel_values.shape[0]} rows")
        # images in passes of at most PASS_ROWS patches (one larger image alone)
        return in_passes(self._pass, pixel_values, grid_thw, patches)

    def _pass(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``forward`` over images that go through the blocks together."""
        layout = _WindowLayout.of_grids(grid_thw, self.spatial_merge_size, self.window_units,
                                        pixel_values.device)
        hidden_states = self.patch_embed(pixel_values[layout.patch_order].to(self.dtype))
        rope = self._rope(layout.positions)
        residual = None
        for index, block in enumerate(self.blocks):
            segments = layout.frames if index in self.fullatt_block_indexes else layout.windows
            hidden_states, residual = block(hidden_states, residual, rope, segments)
        merged = self.merger(hidden_states, residual)  # (units, out), in window order
        out = torch.empty_like(merged)
        out[layout.unit_order] = merged
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named relative to the tower's prefix into this rank's shards; returns
        the names of the parameters loaded. The prefix is ``visual.`` in the checkpoint
        files (the hub's, and what transformers 5 writes) and ``model.visual.`` in
        transformers' module tree."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, loaded_weight in weights:
            name, shards = self._shards(ckpt_name, loaded_weight)
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter "
                                 f"in {type(self).__name__}; is the vision config right?")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            for shard, shard_id in shards:
                weight_loader(param, shard, shard_id)
            loaded.add(name)
        return loaded

    def _shards(self, name: str, tensor: torch.Tensor
                ) -> tuple[str, list[tuple[torch.Tensor, object]]]:
        """The parameter a checkpoint tensor loads into and its (tensor, shard id) parts."""
        if name == "patch_embed.proj.weight":  # Conv3d (E, C, T, P, P) -> (E, C*T*P*P)
            return name, [(tensor.reshape(tensor.shape[0], -1), None)]
        if ".attn.qkv." in name:  # rows | q | k | v |
            return name, list(zip(tensor.chunk(3, dim=0), ("q", "k", "v")))
        for ckpt_name, (packed_name, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_name}." in name:
                return name.replace(f".{ckpt_name}.", f".{packed_name}."), [(tensor, shard_id)]
        return name, [(tensor, None)]
