"""Start-up progress: a few plain lines on stderr while an engine gets ready.

Reading weights, compiling the native kernels on first use, the KV cache's size,
warming up: each says what is happening before it takes its time, so a first start
is not a silent minute. Only rank 0 reports.
"""

from __future__ import annotations

import sys


def progress(message: str) -> None:
    print(f"loom: {message}", file=sys.stderr, flush=True)
