"""NgramProposer: prompt lookup decoding over a request's own tokens, with numpy.

The longest suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens that
also occurs earlier in the sequence proposes the (up to k) tokens that followed its
latest earlier occurrence:

    tokens  a b c d x y a b c ?      suffix "a b c" (n = 3) matched at 0..2
    drafts  d x y                    (k = 3)

Repetitive text (code, quoted input, lists) gets long accepted runs; elsewhere it
proposes nothing and costs nothing but the lookup.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if length < self.min_n + 1:
            return []
        # Earlier positions holding the last token: each may end a match. A match ending
        # at c leaves tokens c + 1 .. to propose (c < length - 1 by construction).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            candidates = ends[ends >= n - 1]
            if candidates.size == 0:
                continue
            offsets = np.arange(n - 1, -1, -1)  # n = 3 -> [2, 1, 0]
            windows = tokens[candidates[:, None] - offsets]  # (C, n), each ending at its c
            matches = candidates[(windows == tokens[length - n:]).all(axis=1)]
            if matches.size:
                start = int(matches[-1]) + 1  # the latest occurrence
                return tokens[start:start + self.k].tolist()
        return []
