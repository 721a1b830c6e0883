"""Shared by every test: forget settings a test read from its patched environment."""

import pytest

from loom.envs import settings


@pytest.fixture(autouse=True)
def _fresh_settings():
    """``loom.envs.settings()`` reads the environment once per process; a test that sets
    a LOOM_* variable calls ``settings.cache_clear()`` after it. Set up before
    ``monkeypatch``, this is torn down after it: the next test reads the restored
    environment."""
    settings.cache_clear()
    yield
    settings.cache_clear()
