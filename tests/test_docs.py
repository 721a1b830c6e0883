"""The user guide: docs/configuration.md is what ``loom.config_reference`` writes from the
commands' parsers now, and the site builds under ``mkdocs build --strict`` (every page
in the nav, every link and anchor inside the guide resolving)."""

from __future__ import annotations

import difflib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from loom import config_reference
from loom.engine_args import EngineArgs

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    written = REFERENCE.read_text(encoding="utf-8")
    current = config_reference.render()
    if written != current:
        diff = "".join(list(difflib.unified_diff(
            written.splitlines(keepends=True), current.splitlines(keepends=True),
            "docs/configuration.md", "generated now"))[:40])
        pytest.fail("docs/configuration.md differs from the flags the code declares; "
                    f"regenerate it: {config_reference.REGENERATE}\n{diff}")


def test_configuration_reference_names_every_flag_and_engine_field():
    page = config_reference.render()
    for command in config_reference.commands():
        for action in command.parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, f"{command.name} {flag} missing"
    for name in EngineArgs.__dataclass_fields__:
        assert f"`{name}`" in page, f"EngineArgs.{name} missing"
    assert "`LOOM_BATCH_INVARIANT`" in page


def test_configuration_reference_imports_no_torch():
    code = ("import sys, loom.config_reference as r; r.render(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _mkdocs_build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def _needs_mkdocs() -> None:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]' installs it)")


def test_guide_builds_strict(tmp_path):
    _needs_mkdocs()
    built = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_strict_build_refuses_a_broken_link_and_anchor(tmp_path):
    """The guide's configuration turns a link to a missing page or anchor into a failure
    (so the test above can fail)."""
    _needs_mkdocs()
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as page:
        page.write("\n[gone](no_such_page.md) and [gone too](server.md#no-such-anchor)\n")
    built = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no_such_page.md" in built.stderr and "no-such-anchor" in built.stderr
