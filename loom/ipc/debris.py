"""Debris: what loom processes killed all at once leave behind, and its removal.

Every shared-memory segment and socket directory loom creates is named after the
PID of the process that owns it (and removes it on any exit it lives through):

    /dev/shm/loom-<pid>-<instance id>-<field>     WorkerSignals (loom.ipc.signal)
    $TMPDIR/loom-<pid>-<instance id>-*/           the task queue's ipc sockets
    $TMPDIR/loom-<pid>-engine-*/                  the engine core's ipc sockets

Children also ask the kernel to kill them when their parent dies
(``die_with_parent``), so no process outlives the one that watches it.

A SIGKILL of the whole process group (the OOM killer, ``docker kill``) leaves them
behind. Each new engine calls ``remove_debris`` first: whatever matches these names
and belongs to a PID that no longer runs is removed, and the log says so.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import tempfile

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^loom-(\d+)-")


def remove_debris(shm_dir: str = SHM_DIR, tmp_dir: str | None = None) -> list[str]:
    """Remove loom segments and socket directories whose owner is gone; returns their paths."""
    removed = []
    for directory in (shm_dir, tmp_dir or tempfile.gettempdir()):
        try:
            entries = os.listdir(directory)
        except OSError:  # no /dev/shm (not Linux): nothing can be left there either
            continue
        for name in entries:
            match = _NAME.match(name)
            if match is None or _pid_alive(int(match.group(1))):
                continue
            path = os.path.join(directory, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:  # another new engine got there first
                continue
            except PermissionError:  # another user's, in a sticky directory: theirs to remove
                continue
            removed.append(path)
    if removed:
        logger.warning("removed %d file(s) left by loom processes that no longer run (killed "
                       "without a chance to clean up): %s", len(removed),
                       ", ".join(sorted(removed)))
    return removed


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: killed, it holds nothing, but its PID
    stays until its parent reaps it, and an orphan's new parent, PID 1, may reap late or
    never (a container whose PID 1 is not an init), which kept the debris of a killed
    group for the next engine to trip over."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: kept (its /proc entry may be hidden)
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone since, or no /proc (not Linux): as kill said then
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, however it dies (elsewhere
    the loops' parent checks end it)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
