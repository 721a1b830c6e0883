"""docs/configuration.md, written from the parser ``loom --help`` is built from.

    python -m loom.config_reference docs/configuration.md

Every flag of every ``loom`` command, grouped as its ``--help`` groups them, with its
value, default and help; ``LLM(...)``'s keyword beside each engine flag; then every
``LOOM_*`` environment switch from ``loom/envs.py``. Nothing here restates a flag: the
commands' parsers (``loom.cli.build_parser``, itself built from ``EngineArgs``' one
declaration) are read as they are, so a flag added there appears here once the page is
regenerated (tests/test_docs.py fails until it is). No heavy imports: building the
parser imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import re
import sys
from dataclasses import dataclass

from loom import arg_types, envs
from loom.cli import build_parser
from loom.engine_args import API, EngineArgs

REGENERATE = "python -m loom.config_reference docs/configuration.md"

# EngineArgs' fields: the flags that are also keywords of LLM(...), under the same name.
_ENGINE_FIELDS = frozenset(spec.name for spec in dataclasses.fields(EngineArgs))

# How a flag's value reads, by the function argparse parses it with.
_VALUE_WORDS = {
    int: "integer", float: "number", str: "text",
    arg_types.positive_int: "integer ≥ 1",
    arg_types.non_negative_int: "integer ≥ 0",
    arg_types.human_readable_int: "integer ≥ 1; 32k = 32,000, 32K = 32,768",
    arg_types.byte_size: "size: 512MiB, 2GiB, 1.5GB or bytes",
    arg_types.fraction: "fraction in (0, 1]",
    arg_types.json_object: "JSON object",
    arg_types.comma_list: "comma-separated names",
    arg_types.port: "port 0..65535",
    arg_types.port_not_zero: "port 1..65535",
}

@dataclass(frozen=True)
class Command:
    """One ``loom`` command (``("bench", "serve")``) and its parser."""

    words: tuple[str, ...]
    help: str | None
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return " ".join(("loom", *self.words))

    @property
    def anchor(self) -> str:
        return "-".join(self.words)


def commands() -> list[Command]:
    """Every command that takes flags of its own, ``loom serve`` first, then the parser's
    order (a command with subcommands, ``loom bench``, only through them)."""
    found: list[Command] = []

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...], help: str | None):
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands:
            found.append(Command(words, help, parser))
        for action in subcommands:
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for word, sub in action.choices.items():
                walk(sub, (*words, word), helps.get(word))

    walk(build_parser(), (), None)
    return sorted(found, key=lambda command: command.words != ("serve",))


def _flags(action: argparse.Action) -> str:
    names = action.option_strings or [action.metavar or action.dest.upper()]
    return ", ".join(f"`{name}`" for name in names)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:  # store_true, store_false, BooleanOptionalAction, help
        return "switch"
    if action.choices is not None:
        text = " \\| ".join(f"`{choice}`" for choice in action.choices)
    elif action.metavar is not None:
        text = f"`{action.metavar}`".replace("|", "\\|")
    else:
        text = _VALUE_WORDS.get(action.type or str, getattr(action.type, "__name__", "text"))
    if action.nargs in ("+", "*"):
        text += ", one or more"
    if isinstance(action, argparse._AppendAction):
        text += "; repeat for more"
    return text


def _default(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return {True: "on", False: "off"}.get(default, "—")
    if action.nargs == 0:  # store_true, store_false: the flag is not given
        return "off"
    if default is None or default == () or default == [] or default == "":
        return "—"
    if isinstance(default, (list, dict)):
        return f"`{json.dumps(default)}`"
    if isinstance(default, tuple):
        return f"`{','.join(map(str, default))}`"
    return f"`{default}`"


def _cell(text: str | None) -> str:
    """Help text as one table cell: on one line, and outside its `code spans` nothing
    Markdown or HTML would read (``</think>``, ``*ForSequenceClassification``)."""
    parts = " ".join((text or "").split()).replace("``", "`").split("`")  # docstrings' ``x``
    for index in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[index] = (parts[index].replace("\\", "\\\\").replace("<", "&lt;")
                        .replace(">", "&gt;").replace("*", "\\*"))
    return "`".join(parts).replace("|", "\\|")


def _fingerprint(group: argparse._ArgumentGroup) -> tuple:
    return (group.title, tuple((tuple(a.option_strings), a.dest, a.help, repr(a.default))
                               for a in _shown(group)))


def _shown(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    return [action for action in group._group_actions
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)]


def _table(actions: list[argparse.Action], with_keyword: bool) -> list[str]:
    header = ["Flag", "Value", "Default", *(["`LLM(...)`"] if with_keyword else []), "Help"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for action in actions:
        cells = [_flags(action), _value(action), _default(action),
                 *([f"`{action.dest}`"] if with_keyword else []), _cell(action.help)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _env_docs() -> dict[str, str]:
    """``Settings``' field docstrings (attribute docstrings: only the source holds them)."""
    tree = ast.parse(inspect.getsource(envs.Settings))
    body = tree.body[0].body
    docs = {}
    for statement, following in itertools.pairwise(body):
        if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _env_section() -> list[str]:
    docs = _env_docs()
    lines = ["## Environment switches {#environment}", "",
             ("Read once per process (`loom/envs.py`). A switch is on unless set to `0` "
              "(also `false`, `no`, `off`); an empty value means unset; any other value "
              "is an error naming the variable."), "",
             "| Variable | Default | Meaning |", "|---|---|---|"]
    for spec in dataclasses.fields(envs.Settings):
        if spec.default is dataclasses.MISSING:
            default = "—"  # a default_factory: the docstring says it
        elif isinstance(spec.default, bool):
            default = "on" if spec.default else "off"
        else:
            default = "—" if spec.default is None else f"`{spec.default}`"
        lines.append(f"| `{spec.metadata['env']}` | {default} | "
                     f"{_cell(docs.get(spec.name))} |")
    return lines


def _command_section(command: Command, seen: dict[tuple, tuple[Command, str]]) -> list[str]:
    """A command's groups as tables; a group already written for an earlier command (the
    engine flags, shared by every command that builds an engine) as a link to it."""
    lines = [f"## {command.name} {{#{command.anchor}}}", ""]
    if command.help:
        lines += [command.help[0].upper() + command.help[1:] + ".", ""]
    if not any(_shown(group) for group in command.parser._action_groups):
        lines += ["No flags but `--help`.", ""]
    for group in command.parser._action_groups:
        actions = _shown(group)
        if not actions:
            continue
        title = group.title[0].upper() + group.title[1:]
        anchor = "-".join((command.anchor, *re.findall(r"\w+", group.title.lower())))
        fingerprint = _fingerprint(group)
        if fingerprint in seen:
            first, first_anchor = seen[fingerprint]
            lines += [f"**{title}**: the same flags as [{first.name}'s](#{first_anchor}).", ""]
            continue
        seen[fingerprint] = (command, anchor)
        lines += [f"### {title} {{#{anchor}}}", ""]
        if group.description:
            lines += [group.description[0].upper() + group.description[1:] + ".", ""]
        with_keyword = all(action.dest in _ENGINE_FIELDS for action in actions)
        lines += [*_table(actions, with_keyword), ""]
    return lines


def render() -> str:
    """The whole page."""
    lines = [
        "# Configuration reference", "",
        f"<!-- Generated by `{REGENERATE}` from the commands' parsers; do not edit. -->", "",
        ("Every flag of every `loom` command, grouped as its `--help` groups them. The "
         "engine flags are declared once (`loom/engine_args.py`) and shared by every "
         "command that builds an engine; each is also a keyword argument of `LLM(...)`, "
         "named in the `LLM(...)` column. A default of — means none, or a value left to "
         "the checkpoint, the device or the rule the help gives."), "",
    ]
    seen: dict[tuple, tuple[Command, str]] = {}
    for command in commands():
        lines += _command_section(command, seen)
    lines += ["## `LLM(...)` only {#llm-only}", "",
              ("Engine arguments with no flag: keywords of `LLM(...)` (and fields of "
               "`EngineArgs`) only. `model` is each command's MODEL."), "",
              "| Keyword | Default |", "|---|---|"]
    lines += [f"| `{spec.name}` | {'—' if spec.default is None else f'`{spec.default}`'} |"
              for spec in dataclasses.fields(EngineArgs) if spec.metadata["scope"] == API]
    lines += ["", *_env_section()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) > 1:
        print(f"usage: {REGENERATE}  (or no path: print the page)", file=sys.stderr)
        return 2
    page = render()
    if args:
        with open(args[0], "w", encoding="utf-8") as out:
            out.write(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
