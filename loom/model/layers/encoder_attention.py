"""An encoder's attention (BERT, ModernBERT): the tokens of each request attend to each
other both ways, computed with SDPA on the step's own q, k and v. No KV cache is read
or written, which is what vLLM means by an encoder-only model having none.

This holds because an encoder runs each prompt whole in one step: the engine turns
chunked prefill and prefix caching off for encoder models (checkpoint_defaults.py), so
a request's new tokens of the step are its whole prompt and its keys are exactly them.
A step of several requests is padded to its longest, each request one row of a batch:

    query_start_loc = [0, 3, 8]        padded (B = 2, L = 5)     key mask
    tokens 0 1 2 | 3 4 5 6 7    ->     | 0 1 2 2 2 |             | 1 1 1 0 0 |
                                       | 3 4 5 6 7 |             | 1 1 1 1 1 |

then the rows' outputs are gathered back into the step's token order; padded queries
are computed and dropped. A sliding window (ModernBERT's local layers) lets a query see
the keys at most ``window`` positions away, on either side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from loom.model.attention.metadata import get_forward_context


@dataclass(frozen=True)
class _Layout:
    """A step's tokens as a padded batch of its requests."""

    num_reqs: int
    max_len: int
    gather: torch.Tensor  # (B * L,) the step token at each padded place
    scatter: torch.Tensor  # (T,) each step token's padded place
    key_valid: torch.Tensor  # (B, 1, 1, L) bool: a real token of the row
    query_pad: torch.Tensor  # (B, 1, L, 1) bool: a padded query (sees every real key)


def _layout(query_start_loc: list[int], device: torch.device) -> _Layout:
    starts = np.asarray(query_start_loc, dtype=np.int64)
    lengths = np.diff(starts)  # [3, 5]
    num_reqs, max_len = len(lengths), int(lengths.max())
    column = np.arange(max_len)
    # [[0, 1, 2, 2, 2], [3, 4, 5, 6, 7]]: a padded place repeats its row's last token
    gather = starts[:-1, None] + np.minimum(column[None, :], lengths[:, None] - 1)
    valid = column[None, :] < lengths[:, None]
    # token t of request b sits at b * L + (t - starts[b]): [0, 1, 2, 5, 6, 7, 8, 9]
    scatter = np.repeat(np.arange(num_reqs) * max_len - starts[:-1], lengths) \
        + np.arange(starts[-1])
    valid_tensor = torch.from_numpy(valid).to(device)
    return _Layout(num_reqs, max_len, torch.from_numpy(gather.reshape(-1)).to(device),
                   torch.from_numpy(scatter).to(device),
                   valid_tensor[:, None, None, :], ~valid_tensor[:, None, :, None])


def _band(length: int, window: int, device: torch.device) -> torch.Tensor:
    """(L, L) bool: |i - j| <= window."""
    index = torch.arange(length, device=device)
    return (index[:, None] - index[None, :]).abs() <= window


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """q, k, v (T, H, D) of the step's tokens -> (T, H * D): each token attends to every
    token of its own request (``window``: to those at most this many positions away)."""
    num_tokens, num_heads, head_dim = q.shape
    metadata = get_forward_context()
    starts = metadata.query_start_loc_cpu
    if len(starts) == 2:  # one request: no padding
        mask = None if window is None else metadata.cached(
            ("encoder_band", window), lambda: _band(num_tokens, window, q.device))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask, scale=scale)
        return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
    layout: _Layout = metadata.cached("encoder_layout", lambda: _layout(starts, q.device))
    mask = layout.key_valid
    if window is not None:
        mask = metadata.cached(("encoder_band_mask", window), lambda: layout.key_valid & (
            _band(layout.max_len, window, q.device) | layout.query_pad))
    batch = (layout.num_reqs, layout.max_len, num_heads, head_dim)

    def padded(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (B, H, L, D)
        return x[layout.gather].view(batch).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask,
                                         scale=scale)  # (B, H, L, D)
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)
    return out[layout.scatter]
