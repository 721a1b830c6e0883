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


# -- what the project's files say of themselves -------------------------------------------

# Labels of working periods, issue numbers and talk of who else used a machine: the
# project's files describe loom, its results and its methods, a machine by what it is.
_NOT_OF_THE_PROJECT = (
    r"session [0-9]+",
    r"\(issue [0-9]+|issue [0-9]+\)|issue #[0-9]+|of issue [0-9]+",
    r"shared with other (work|jobs|people|users)",
    r"-s[0-9]{2}[.-]",  # a result file named for a working period (interleaved-...-s23.json)
)


def _tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return [name for name in listed if name != "tests/test_docs.py"]


def test_no_working_period_labels_or_issue_numbers():
    import re

    pattern = re.compile("|".join(_NOT_OF_THE_PROJECT), re.IGNORECASE)
    found = []
    for name in _tracked_files():
        if pattern.search(name):
            found.append(f"{name} (its name)")
        path = ROOT / name
        if path.suffix in (".png", ".svg", ".gguf") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "say what loom is and does, not when or by whom:\n" + "\n".join(found[:30])


def test_version_is_one_everywhere():
    import tomllib

    import loom

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    released = [line.split("]")[0][4:] for line in changelog.splitlines()
                if line.startswith("## [") and not line.startswith("## [Unreleased]")]
    assert released and released[0] == project == loom.__version__, (released[:1], project,
                                                                      loom.__version__)
    shown = subprocess.run([sys.executable, "-m", "loom.cli", "--version"], capture_output=True,
                           text=True, check=False, cwd=ROOT)
    assert shown.returncode == 0 and shown.stdout.strip() == f"loom {project}", shown


def test_every_result_file_is_on_the_results_page_or_named():
    """benchmarks/make_results.py reads every file in benchmarks/results/ or says why not,
    and README's summary lies between its markers, so the page can be regenerated."""
    spec = importlib.util.spec_from_file_location("make_results",
                                                  ROOT / "benchmarks" / "make_results.py")
    make_results = importlib.util.module_from_spec(spec)
    sys.modules["make_results"] = make_results  # its dataclasses look their module up
    try:
        spec.loader.exec_module(make_results)
    finally:
        del sys.modules["make_results"]
    assert make_results.unaccounted() == []
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert make_results.SUMMARY_BEGIN in readme and make_results.SUMMARY_END in readme
    assert len(readme.splitlines()) <= 150, "README.md is the front page: keep it short"
