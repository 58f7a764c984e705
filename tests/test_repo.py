"""Repo-wide properties: the layout every script shares, and its --help convention."""

from __future__ import annotations

import argparse
import ast
import re

import pytest

from launch import REPO, load_script

SCRIPTS = sorted(REPO.glob("0[1-6]_*.py"))
BEGIN = "# ==== shared plumbing: begin"
END = "# ==== shared plumbing: end"
MAX_SHARED_LINES = 220


def shared_block(text: str) -> str:
    start = text.index(BEGIN)
    stop = text.index("\n", text.index(END, start)) + 1
    return text[start:stop]


def test_six_scripts():
    assert [p.name[:3] for p in SCRIPTS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


def test_shared_plumbing_is_identical_in_every_script_and_within_its_cap():
    reference = shared_block(SCRIPTS[0].read_text())
    assert "def setup(" in reference and "def launch(" in reference
    lines = len(reference.splitlines())
    assert lines <= MAX_SHARED_LINES, f"the shared block has {lines} lines"
    for script in SCRIPTS[1:]:
        assert shared_block(script.read_text()) == reference, \
            f"{script.name} drifted from {SCRIPTS[0].name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_lesson_comes_first_and_plumbing_last(script):
    text = script.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    begin = next(i for i, line in enumerate(lines, 1) if line.startswith(BEGIN))
    end = next(i for i, line in enumerate(lines, 1) if line.startswith(END))
    # the first definition is the lesson's, near the top
    assert defs[0].lineno < begin and defs[0].lineno <= 100, \
        f"first definition {defs[0].name} at line {defs[0].lineno}"
    # main and the CLI come before the shared block; only the entry point follows it
    names_before = [n.name for n in defs if n.lineno < begin]
    assert "main" in names_before and "parse_args" in names_before
    tail = [n for n in tree.body if n.lineno > end]
    assert len(tail) == 1 and isinstance(tail[0], ast.If), "only `if __name__ ...` follows"
    # the short note that names the plumbing stays short and identical
    note = re.search(r"^# The plumbing used below.*?(?=\n\n)", text, re.M | re.S)
    assert note and len(note[0].splitlines()) <= 8


def test_03_lesson_within_its_line_budget():
    # 400 when the lesson-first issue set it (395 then); raised to 470 for what issue 13
    # added: torch.compile with its warm-up, comm hooks with PowerSGD's Gloo fix, the
    # static_graph + accumulation fix, the unused-layer demo, their checks (469 now)
    text = (REPO / "03_ddp_train.py").read_text()
    outside = len(text.splitlines()) - len(shared_block(text).splitlines())
    assert outside <= 470, f"03 has {outside} lines outside the shared block"


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_option_has_one_help_line_with_its_default_once(script):
    parser = load_script(script.name).build_parser()
    problems = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1]
        text = option_help(parser, action) if action.help else ""
        if not text.strip():
            problems.append(f"{name}: no help")
            continue
        if text.count("default") > 1:
            problems.append(f"{name}: the default appears twice: {text!r}")
        if "None" in text:
            problems.append(f"{name}: says None: {text!r}")
        shown = action.default not in (None, False, True) and not isinstance(
            action, argparse.BooleanOptionalAction)
        if shown and "default" not in text:
            problems.append(f"{name}: default {action.default!r} not shown: {text!r}")
    assert not problems, "\n".join(problems)
    formatted = parser.format_help()
    assert "(default: None)" not in formatted and ") (default:" not in formatted
