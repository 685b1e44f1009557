"""The README stays true: its examples are the files the tests run, its configuration table is complete."""

from __future__ import annotations

import re
from pathlib import Path

from orbit_server.settings import ServerSettings

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_python_examples_are_the_files_in_examples() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README shows no Python example"
    for block in blocks:
        first = block.splitlines()[0]
        assert first.startswith("# examples/"), (
            f"a README example must name its file on its first line: {first!r}"
        )
        path = REPO / first.removeprefix("# ")
        assert path.read_text(encoding="utf-8") == block, f"{path} and its README copy differ"


def test_every_server_setting_is_documented() -> None:
    for name in ServerSettings.model_fields:
        assert f"`ORBIT_{name.upper()}`" in README, f"ORBIT_{name.upper()} is missing from the README"


def test_quick_start_commands() -> None:
    assert "make demo" in README and "make test" in README
