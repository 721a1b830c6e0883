"""The errors an engine raises to its callers, whichever layer finds them.

The executor raises them (``loom/executor``), the engine core and the API process catch
them (``loom/core/engine_core.py``, ``loom/async_llm.py``), and a worker raises
``WeightsLostError`` for the executor to pass on; so they live below all of those and
import nothing.

    EngineDeadError            every request in flight failed; rebuild the engine
      └─ WorkerDiedError       a rank exited, stopped beating or raised
           └─ WorkerHungError  a rank lives but makes no progress
    RPCError                   a collective_rpc method raised; the ranks serve on
    WeightsLostError           a weight update failed mid-copy; the ranks hold no weights
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The workers can no longer run steps; every request in flight has failed and the
    engine must be rebuilt."""


class WorkerDiedError(EngineDeadError):
    """A worker process exited, stopped heart-beating or raised."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class WorkerHungError(WorkerDiedError):
    """A worker process lives but makes no progress: a step past its time bound, or an
    idle event loop that stopped running."""


class RPCError(RuntimeError):
    """A worker method run by collective_rpc raised (other than ValueError or
    FileNotFoundError); the ranks serve on."""


class WeightsLostError(RuntimeError):
    """A weight update that failed while copying (after its checks passed): the
    half-written weights were freed on every rank, which now hold none, as after
    ``sleep(2)``; an update that succeeds (or ``wake_up``) brings weights back."""
