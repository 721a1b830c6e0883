"""A kernel build killed mid-way leaves torch's lock file behind; the next load must not
wait for it forever (it wedged every later server start in a loaded CI run)."""

from __future__ import annotations

import subprocess
import sys

LOAD = """
import sys
from loom import kernels
build_dir = kernels._build_dir()
build_dir.mkdir(parents=True, exist_ok=True)
(build_dir / "lock").touch()  # what a killed build leaves
module = kernels.native_ops()
print("loaded" if module is not None else "unavailable",
      "lock gone" if not (build_dir / "lock").exists() else "lock kept")
"""


def test_a_stale_build_lock_does_not_wedge_the_next_load():
    run = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["loaded", "lock", "gone"], run.stdout + run.stderr
    assert "killed mid-way" in run.stderr
