"""Vision towers of multimodal families: pixels in, the language model's embeddings out.

Each tower takes what its checkpoint's own ``transformers`` image processor made
(``pixel_values`` and, where the family has one, ``image_grid_thw``) and returns one row
per placeholder token the prompt holds for those images, in the language model's hidden
size. The family's model class (``loom/model/models``) owns the tower, loads its weights
and puts its rows in place of the placeholder tokens' embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


def tower_weights_on_the_way(weights: Iterable[tuple[str, torch.Tensor]],
                             route: Callable[[str], tuple[bool, str]], tower: nn.Module,
                             loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors, yielded as the checkpoint gives them, while each of
    the tower's is loaded into ``tower`` as it arrives (its names added to ``loaded``).
    ``route(name)`` is (to the tower?, the name there). No tensor is held past its own
    load, so reading a multimodal checkpoint peaks at the model plus one tensor, not
    twice the weights. The caller's language loader must consume the whole stream."""
    for name, tensor in weights:
        to_tower, ours = route(name)
        if to_tower:
            loaded.update(tower.load_weights([(ours, tensor)]))
        else:
            yield ours, tensor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


# patch rows a tower's blocks run at once: a batch's images go through in passes of at
# most this many (an image of more alone), so that every activation of a 1B-class tower
# (its MLP's widest: 2,048 x 6,840 bf16, 28 MB) stays under glibc's 32 MiB mmap threshold
# and is reused from block to block instead of page-faulted afresh (8 Qwen2.5-VL images
# of 1,024 patches in one pass faulted 10 GB of pages: 16.4 s, against 13.3 s in passes
# of 2,048 rows, 2 cores). Matmuls of 2,048 rows run at the rate of larger ones.
PASS_ROWS = 2048


def image_passes(rows: list[int], max_rows: int | None = None) -> list[range]:
    """The images (by index) of each pass, in order: consecutive images whose ``rows``
    sum to at most ``max_rows`` (None: ``PASS_ROWS``), an image of more alone."""
    max_rows = PASS_ROWS if max_rows is None else max_rows
    passes: list[range] = []
    first, total = 0, 0
    for image, count in enumerate(rows):
        if image > first and total + count > max_rows:
            passes.append(range(first, image))
            first, total = image, 0
        total += count
    if rows:
        passes.append(range(first, len(rows)))
    return passes


def in_passes(run: Callable[[torch.Tensor, list], torch.Tensor], pixel_values: torch.Tensor,
              grids: list, rows: list[int], pixel_rows: list[int] | None = None
              ) -> torch.Tensor:
    """``run(pixel_values, grids)`` over the images in passes (``image_passes``: image i
    makes ``rows[i]`` patch rows from ``pixel_rows[i]`` of ``pixel_values``' rows, by
    default ``rows[i]``), its outputs concatenated in image order. For a tower whose
    every row depends on its own image alone: the same rows, bit for bit, as one pass
    over all."""
    passes = image_passes(rows)
    if len(passes) <= 1:
        return run(pixel_values, grids)
    bounds = [0]
    for count in rows if pixel_rows is None else pixel_rows:
        bounds.append(bounds[-1] + count)
    return torch.cat([run(pixel_values[bounds[p.start]:bounds[p.stop]], grids[p.start:p.stop])
                      for p in passes])


# rows the rope rotates at a time: its float32 temporaries stay in cache and under
# glibc's 32 MiB mmap threshold, where over many images' rows at once each was a fresh
# mapping, page-faulted in every block
ROPE_ROWS = 512


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in float32, rounded to ``dtype``,
    ``ROPE_ROWS`` rows at a time (bit for bit the same as over every row at once)."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for start in range(0, x.shape[0], ROPE_ROWS):
        rows = slice(start, start + ROPE_ROWS)
        chunk = x[rows].float()
        out[rows] = chunk * cos[rows] + rotate_half(chunk) * sin[rows]
    return out


def native_attention_within(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            lengths: torch.Tensor) -> torch.Tensor | None:
    """Bidirectional attention within consecutive segments of ``lengths`` (int64, CPU)
    rows by loom's bf16 kernel (kernels/csrc/segment_attention.cpp), where it applies:
    bfloat16 CPU tensors (N, H, D) with contiguous features, D a multiple of 16 up to 128,
    an AVX512-BF16 CPU. It runs a Qwen2.5-VL tower's windows and images at twice
    PyTorch's SDPA speed. (N, H, D), or None: the caller runs SDPA (as every float32
    tower does, the one the token-exact tests compare)."""
    if q.dtype != torch.bfloat16:
        return None
    from loom.kernels import native_ops_for

    ops = native_ops_for(q.device, q.dtype)
    head_dim = q.shape[-1]
    if (ops is None or not ops.segment_attention_available() or head_dim % 16
            or head_dim > 128 or any(x.stride(-1) != 1 for x in (q, k, v))):
        return None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ops.segment_attention(out, q, k, v, lengths, head_dim ** -0.5)
    return out


def rope_attention_within(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor,
                          lengths: list[int]) -> torch.Tensor:
    """A tower's bidirectional attention within each segment (an image or a frame) of
    its patches: ``q``, ``k``, ``v`` (N, H, D), the rope's ``cos``, ``sin`` (N, 1, D)
    applied to q and k in float32 as the references do, the N patches cut into
    ``lengths``; returns (N, H * D)."""
    q, k = _rotate(q, cos, sin, v.dtype), _rotate(k, cos, sin, v.dtype)
    out = native_attention_within(q, k, v, torch.tensor(lengths, dtype=torch.int64))
    if out is not None:
        return out.reshape(out.shape[0], -1)
    # (H, L, D) per segment: no patch attends outside its own
    q, k, v = (x.transpose(0, 1).split(lengths, dim=1) for x in (q, k, v))
    out = torch.cat([F.scaled_dot_product_attention(*segment) for segment in zip(q, k, v)],
                    dim=1)
    return out.transpose(0, 1).reshape(out.shape[1], -1)
