"""Moved: every type that crosses a process boundary is in ``loom.core.wire``.

This re-export remains only until loom/metrics.py and benchmarks/warm_up.py import
from ``loom.core.wire``; then it goes, and with it the clash with ``loom.outputs``
(the user-facing ``RequestOutput``).
"""

from loom.core.wire import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                            NewRequestData, SampleLogprobs, SchedulerOutput)

__all__ = ["CachedRequestData", "EngineCoreOutput", "ModelRunnerOutput", "NewRequestData",
           "SampleLogprobs", "SchedulerOutput"]
