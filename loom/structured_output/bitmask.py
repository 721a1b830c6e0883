"""Worker side: apply the engine core's grammar bitmask to logits before sampling."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
    """Set ``logits[rows[i], t] = -inf`` wherever bit t of bitmask row i is 0; in place.

    logits: (B, V). bitmask: len(rows) rows of ceil(V / 32) int32 words, little-endian;
    bit j of word w allows token 32 * w + j. A row of -1 in ``rows`` is skipped.
    """
    words = np.frombuffer(bitmask, dtype="<i4").reshape(len(rows), -1)  # (N, W)
    keep = [i for i, row in enumerate(rows) if row >= 0]
    if not keep:
        return
    vocab_size = logits.shape[-1]
    packed = torch.from_numpy(words[keep].astype(np.int32)).to(logits.device)  # (n, W)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # (n, W, 1) >> (32,) -> (n, W, 32) -> (n, W * 32): token t is bit t % 32 of word t // 32
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(keep), -1)
    allowed = allowed[:, :vocab_size]
    if allowed.shape[1] < vocab_size:  # a mask narrower than the logits disallows the rest
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    index = torch.tensor([rows[i] for i in keep], dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
