"""Repo-wide properties: the shared boilerplate has not drifted between scripts."""

from __future__ import annotations

import re

from launch import REPO

START = "# Distributed boilerplate: the same code, in the same order, in all six scripts."
END = re.compile(r"^# -{70,}\n# (?!Distributed boilerplate)", re.M)


def boilerplate(path) -> str:
    text = path.read_text()
    start = text.index(START)
    return text[start:END.search(text, start).start()].rstrip()


def test_distributed_boilerplate_is_identical_in_every_script():
    scripts = sorted(REPO.glob("0[1-6]_*.py"))
    assert len(scripts) >= 2
    reference = boilerplate(scripts[0])
    assert "def setup(" in reference and "def launch(" in reference
    for script in scripts[1:]:
        assert boilerplate(script) == reference, f"{script.name} drifted from {scripts[0].name}"
