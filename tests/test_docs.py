"""The documentation stays true (issue 29): the README is short and points only at pages that exist, its
abridged example is made of the files the tests run, every example a page shows is the file in ``examples/``,
the settings table is the server's settings, the CLI reference and the Performance table are generated, and
the site builds offline.

The walkthrough that runs every shell block of the pages is ``tests/acceptance/test_docs_walkthrough.py``;
``make test`` builds the site with ``mkdocs build --strict`` (broken links, unknown anchors, missing Python
references fail)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import click
import yaml

from orbit_server.settings import ServerSettings
from tests.docs_pages import DOCS, REPO, nav_pages, page

README = (REPO / "README.md").read_text(encoding="utf-8")


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "_hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _all_pages() -> dict[str, str]:
    return {"README.md": README, **{f"docs/{p}": page(p) for p in nav_pages()}}


def test_every_page_is_in_the_navigation_and_every_navigation_entry_exists() -> None:
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_hooks" not in p.parts}
    assert on_disk == set(nav_pages())


def test_the_readme_is_short_and_links_only_to_pages_that_exist() -> None:
    assert len(README.splitlines()) <= 200
    assert "make demo" in README and "make test" in README
    for target in re.findall(r"\]\((?!https?:)([^)#]+)(?:#[^)]*)?\)", README):
        assert (REPO / target).exists(), f"the README links to {target}, which does not exist"


def test_python_examples_are_the_files_in_examples() -> None:
    """A page's Python block that names a file on its first line is that file, byte for byte."""
    shown = 0
    for name, text in _all_pages().items():
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            first = block.splitlines()[0]
            if not first.startswith("# examples/"):
                continue
            path = REPO / first.removeprefix("# ")
            assert path.read_text(encoding="utf-8") == block, f"{path} and its copy in {name} differ"
            shown += 1
    assert shown >= 7


def test_the_readme_example_is_abridged_from_the_files_it_names() -> None:
    """Every line of code of the README's example is a line of the example files it names (which run whole)."""
    [block] = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    named = re.findall(r"`(examples/\w+\.py)`", README.split("```python", 1)[0].strip().rsplit("\n\n", 1)[1])
    assert len(named) == 2, named

    def code(line: str) -> str:  # the line without its indentation and its comment
        return line.split("  # ", 1)[0].strip()

    lines = {code(line) for path in named for line in (REPO / path).read_text("utf-8").splitlines()}
    for line in block.splitlines():
        if code(line) and not code(line).startswith("#"):
            assert code(line) in lines, f"README example line {line!r} is in none of {named}"


def _settings_rows() -> dict[str, str]:
    server = page("reference/settings.md").split("## The server", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(ORBIT_[A-Z_]+)` \| (.*?) \|", server, flags=re.M))


def test_the_settings_table_is_the_servers_settings() -> None:
    """Every field of ServerSettings has a row with its default, and every row is a field or an option of
    ``orbit-server``."""
    from orbit_server.cli import main as server_main

    rows = _settings_rows()
    envvars = _hook("cli_envvars").envvars(server_main)
    fields = {f"ORBIT_{name.upper()}": field for name, field in ServerSettings.model_fields.items()}
    assert set(fields) <= set(rows), f"settings without a row: {set(fields) - set(rows)}"
    extra = set(rows) - set(fields) - set(envvars)
    assert extra == set(), f"rows that are neither a setting nor an option: {extra}"
    for name, field in fields.items():
        shown = rows[name].strip("`")
        default = field.default
        if default is None:
            assert shown == "unset", (name, shown)
        elif isinstance(default, bool):
            assert shown == str(default).lower(), (name, shown)
        elif isinstance(default, int | float):
            assert float(shown) == float(default), (name, shown, default)
        elif default == "":
            assert shown == "empty", (name, shown)
        else:
            assert shown == default, (name, shown, default)
    for name in set(rows) - set(
        fields
    ):  # options of the command line alone: the default shown is the option's
        [(_, option), *_] = envvars[name]
        if isinstance(option.default, int | float) and not isinstance(option.default, bool):
            assert float(rows[name].strip("`")) == float(option.default), (name, rows[name], option.default)


def test_the_cli_reference_is_generated_from_both_commands() -> None:
    text = page("reference/cli.md")
    directives = re.findall(r"::: mkdocs-click\n((?:    :.*\n)+)", text)
    seen = {}
    for directive in directives:
        options = dict(re.findall(r":(\w+): (.*)", directive))
        module = importlib.import_module(options["module"])
        command = getattr(module, options["command"])
        assert isinstance(command, click.Group)
        seen[options["prog_name"]] = int(options["depth"])
    assert seen == {"orbit-server": 2, "orbit-outbox": 2}


def test_the_settings_page_generates_the_outbox_variables() -> None:
    from outbox_adapter.cli import main as outbox_main

    table = _hook("cli_envvars").table("orbit-outbox")
    for name in _hook("cli_envvars").envvars(outbox_main):
        assert f"| `{name}` |" in table
    assert "<!-- cli-envvars: orbit-outbox -->" in page("reference/settings.md")


def test_the_performance_table_is_every_figure_of_the_newest_results_file(tmp_path: Path) -> None:
    hook = _hook("bench_results")
    assert "<!-- bench-results: compare -->" in page("explanation/performance.md")
    figures = [
        {"section": "peer", "name": "peer: worker processed", "value": 268.4, "unit": "jobs/s"},
        {"section": "orbit", "name": "orbit: worker processed", "value": 933.2, "unit": "tasks/s",
         "base": "peer: worker processed", "ratio": 3.477, "target": "≥ 1.5×", "passed": True},
    ]  # fmt: skip
    meta = {"date": "2026-12-01T10:00:00Z", "commit": "abc123", "command": "python -m bench.compare --n 2000",
            "machine": {"cpu": "Some CPU", "cores": 2, "platform": "Linux"}, "loadavg_at_start": [1.0, 1.2, 1.3],
            "mariadb": {"version": "10.11"}, "postgres": {"version": "15"}, "n": 2000, "concurrency": 4}  # fmt: skip
    for day in ("2026-11-01", "2026-12-01"):
        (tmp_path / f"compare-{day}.json").write_text(json.dumps({"figures": figures, "meta": meta}))
    newest = hook.newest("compare", tmp_path)
    assert newest.name == "compare-2026-12-01.json"
    rendered = hook.render(newest)
    for text in ("compare-2026-12-01.json", "2026-12-01T10:00:00Z", "abc123", "python -m bench.compare --n 2000",
                 "Some CPU", "1.00, 1.20, 1.30", "268 jobs/s", "933 tasks/s", "3.48×", "≥ 1.5×"):  # fmt: skip
        assert text in rendered, text
    assert "No compare results file" in hook.missing("compare")
    assert hook.newest("compare", tmp_path / "none") is None


def test_the_performance_page_shows_the_newest_run_per_server_database(tmp_path: Path) -> None:
    """Issue 32: a run with Orbit's server on PostgreSQL does not hide the newest one on MariaDB, nor the
    reverse; a variant's files (``chaos-galera-...``) are not the plain kind's."""
    hook = _hook("bench_results")
    figures = [{"section": "orbit", "name": "orbit: worker processed", "value": 900.0, "unit": "tasks/s"}]

    def write(name: str, server_db: str | None) -> None:
        meta = {"date": name[8:18], "commit": "abc", "command": "python -m bench.compare",
                "settings": {"server_db": server_db} if server_db else {}}  # fmt: skip
        (tmp_path / name).write_text(json.dumps({"figures": figures, "meta": meta}))

    write("compare-2026-11-01-a.json", None)  # before the setting: MariaDB
    write("compare-2026-11-20-b.json", "mariadb")
    write("compare-2026-12-01-c.json", "postgres")
    write("compare-2026-12-02-d.json", None)
    runs = hook.newest_per_server_db("compare", tmp_path)
    assert [(db, path.name) for db, path in runs] == [
        ("mariadb", "compare-2026-12-02-d.json"),
        ("postgres", "compare-2026-12-01-c.json"),
    ]
    (tmp_path / "chaos-galera-2026-12-04-e.json").write_text(json.dumps({"figures": figures, "meta": {}}))
    assert hook.newest("chaos", tmp_path) is None
    assert hook.newest("chaos-galera", tmp_path).name == "chaos-galera-2026-12-04-e.json"
    assert "<!-- bench-results: chaos-postgres -->" in page("explanation/fault-suite.md")


def test_every_committed_results_file_says_where_when_and_how() -> None:
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        document = json.loads(path.read_text(encoding="utf-8"))
        assert document["figures"], path
        assert {"date", "commit", "command", "machine", "loadavg_at_start"} <= set(document["meta"]), path


def test_the_site_loads_nothing_from_the_network() -> None:
    """System fonts (no font CDN); every page's links to assets stay on the site."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["theme"]["font"] is False
    assert config["strict"] is True
    for name, text in _all_pages().items():
        assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"https?://", text), name


def test_every_readme_section_a_message_cites_has_a_page() -> None:
    """Messages, log lines and docstrings cite the README by section (``README "Tracing"``); the README's
    index of those sections names the page each one lives on now."""
    index = dict(
        re.findall(
            r"^\| ([^|]+?) \| \[[^]]+\]\(([^)]+)\) \|$",
            README.split("## Sections named in messages")[1],
            re.M,
        )
    )
    for target in index.values():
        assert (REPO / target.split("#")[0]).exists(), target
    cited = set()
    for root in ("orbit_client", "orbit_server", "outbox_adapter", "examples"):
        for path in (REPO / root).rglob("*.py"):
            # One line, with adjacent string literals and comment continuations joined.
            text = " ".join(path.read_text(encoding="utf-8").split())
            text = re.sub(r"""(['"]) \1""", "", re.sub(r" #:? ", " ", text))
            cited |= {(path.name, name) for name in re.findall(r'README "([^"]+)"', text)}
            cited |= {(path.name, name) for name in re.findall(r"README, ([A-Z][a-z ]+[a-z])", text)}
    missing = sorted(f"{file}: {name}" for file, name in cited if name not in index)
    assert missing == [], missing
