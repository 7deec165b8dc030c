"""The documents stay true to the code: docs/api.md's flags table is what `roseinfer serve --help`
says, the README stays a front door, and no document names a path of someone's machine, a link
that leads nowhere or a command that does not exist.

Regenerate the flags table after changing a flag:
    python -c 'import roseinfer.cli as c; c.write_docs_flags()'
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from roseinfer import cli

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a developer's files live, never where a user's do.
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/root/|/home/|/tmp/|/Users/|~/|\.\./shared/)|[A-Z]:\\\\")


def test_api_flags_table_is_serve_help() -> None:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert cli.docs_with_flags(text) == text, (
        "docs/api.md's flags table differs from `roseinfer serve --help`; regenerate it with "
        "python -c 'import roseinfer.cli as c; c.write_docs_flags()'")


def test_flags_table_lists_every_serve_flag() -> None:
    parser = cli.command_parser("serve")
    table = cli.flags_markdown(parser)
    cells = set(re.findall(r"^\| `([^`]*)`", table, flags=re.M))
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert any(action.option_strings[0] in cell.split() or f"{action.option_strings[0]}," in cell
                       for cell in cells), action.option_strings
    assert "| `--port PORT` | `8000` |" in table


def test_docs_with_flags_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        cli.docs_with_flags("no markers here")


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; reference belongs in docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_no_path_of_a_developers_machine(path: Path) -> None:
    found = [f"{number}: {line.strip()}" for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, f"{path.name} names paths of a developer's machine:\n" + "\n".join(found)


def _anchors(path: Path) -> set[str]:
    """The fragment each heading of `path` gets on GitHub."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_relative_links_lead_somewhere(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        linked = path.parent / file if file else path
        assert linked.exists(), f"{path.name} links to {target}, which is not there"
        if fragment and linked.suffix == ".md":
            assert fragment in _anchors(linked), f"{path.name} links to {target}: no such heading"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _invocations(text: str) -> list[str]:
    """`roseinfer ...` command lines: inline code spans and lines of code blocks (with their
    backslash continuations)."""
    found = re.findall(r"`(roseinfer [^`]+)`", text)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("roseinfer "):
                found.append(line)
    return found


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_commands_and_flags_named_exist(path: Path) -> None:
    commands = _subcommands(cli.build_parser())
    for invocation in _invocations(path.read_text(encoding="utf-8")):
        words = re.sub(r"'[^']*'|\"[^\"]*\"", "VALUE", invocation).split()  # a quoted value is no flag
        assert words[1] in commands, f"{path.name}: `{invocation}`: no command {words[1]!r}"
        parser = commands[words[1]]
        if words[1] == "bench" and len(words) > 2 and words[2][0].isalpha():
            benches = _subcommands(parser)
            assert words[2] in benches, f"{path.name}: `{invocation}`: no bench {words[2]!r}"
            parser = benches[words[2]]
        options = {option for action in parser._actions for option in action.option_strings}
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", " ".join(words)):
            assert flag in options, f"{path.name}: `{invocation}`: {flag} is not a flag of it"
