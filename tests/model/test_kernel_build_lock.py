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
      "lock gone" if not (build_dir / "lock").exists() else "lock kept",
      "build-tools" if "torch.utils.cpp_extension" in sys.modules else "no-build-tools")
"""


def test_a_stale_build_lock_does_not_wedge_the_next_load():
    """Also: a load of the cached build (this process built it, if nobody had) leaves
    torch's build tools (and setuptools) unimported: every worker process loads it."""
    from loom.kernels import native_ops

    assert native_ops() is not None
    run = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["loaded", "lock", "gone", "no-build-tools"], \
        run.stdout + run.stderr
    assert "killed mid-way" in run.stderr


def test_a_truncated_cached_build_is_built_again(tmp_path, monkeypatch, caplog):
    """A link killed mid-way leaves a truncated .so in the cache: the next load removes it
    and builds again, rather than fall back to PyTorch ops for good. (A unit: the build
    itself is torch's ``load``, stood in for here; the real import of the truncated file
    fails as dlopen fails on it.)"""
    import logging

    import torch.utils.cpp_extension

    from loom import kernels
    from loom.envs import settings

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    settings.cache_clear()
    build_dir = kernels._build_dir()
    build_dir.mkdir(parents=True)
    built = build_dir / "loom_cpu_ops.so"
    built.write_bytes(b"\x7fELF truncated")
    rebuilt = []

    class Module:
        def set_bf16_amx(self, enabled):
            pass

        def set_batch_invariant(self, on):
            return True

    def load(**kwargs):
        assert not built.exists()  # removed before the build
        rebuilt.append(kwargs["build_directory"])
        return Module()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    caplog.set_level(logging.WARNING)
    try:
        module = kernels._load()
    finally:
        settings.cache_clear()
    assert isinstance(module, Module) and rebuilt == [str(build_dir)]
    assert any("does not load" in r.getMessage() for r in caplog.records)
