"""deploy/: the Prometheus alert rules and the Grafana dashboard name only metrics the processes export,
and the docs' "Metrics and alerts" (docs/reference/metrics-and-alerts.md) explains every alert with commands
that exist."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from prometheus_client import CollectorRegistry

from orbit_client import _metrics as worker_metrics
from orbit_server.api.metrics import Metrics
from orbit_server.cli import main as server_cli
from orbit_server.db.sampling import Sample
from outbox_adapter._metrics import ConsumerMetrics, RelayMetrics
from outbox_adapter.cli import main as outbox_cli

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "orbit-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "orbit-dashboard.json"
#: Metrics Prometheus itself makes from a scrape.
PROMETHEUS_OWN = {"up"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of ``registry`` can show, whether or not a labelled child exists yet."""
    names = set()
    for family in registry.collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def exported() -> set[str]:
    server = Metrics()
    server.sampled.store(
        Sample(tasks={("ns", "q", "WAITING"): 1}, review_oldest=1.0, deliveries={("ns", "s"): (1, 2.0)})
    )
    relay = RelayMetrics()
    relay.backlog.store({"PENDING": 1, "NEEDS_RECONCILE": 0, "DEAD": 0}, 3.0)
    return (
        _names(server.registry)
        | _names(relay.registry)
        | _names(ConsumerMetrics().registry)
        | _names(worker_metrics.registry())
    )


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in doc["panels"] for target in panel.get("targets", [])]


def _metrics_in(expr: str) -> set[str]:
    words = set(re.findall(r"\b[a-z_][a-z0-9_]*\b", re.sub(r'"[^"]*"', "", expr)))
    return {w for w in words if w.startswith("orbit_")} | (words & PROMETHEUS_OWN)


def test_every_metric_the_alerts_and_the_dashboard_name_is_exported() -> None:
    names = exported()
    exprs = [rule["expr"] for rule in _alert_rules()] + _dashboard_exprs()
    assert len(exprs) > 20
    used = set().union(*(_metrics_in(e) for e in exprs))
    assert used - names - PROMETHEUS_OWN == set()
    # What the issue asks the alerts to watch.
    for wanted in ("orbit_outbox_oldest_pending_age_seconds", "orbit_outbox_rows", "orbit_review_backlog_tasks",
                   "orbit_result_delivery_oldest_unacked_age_seconds", "up", "orbit_worker_lease_lost_total"):  # fmt: skip
        assert any(wanted in _metrics_in(rule["expr"]) for rule in _alert_rules()), wanted


def test_metric_names_follow_prometheus_conventions() -> None:
    for name in exported():
        assert re.fullmatch(r"orbit_[a-z0-9_]+", name), name
        assert not name.endswith("_total_total"), name
        if "duration" in name or "age" in name:
            assert re.search(r"_seconds(_bucket|_sum|_count)?$", name), name


def test_each_rule_is_complete_and_explained_in_the_readme() -> None:
    section = (REPO / "docs" / "reference" / "metrics-and-alerts.md").read_text()
    for rule in _alert_rules():
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and "Metrics and alerts" in rule["annotations"]["description"]
        assert f"| `{rule['alert']}` |" in section, f"the docs do not explain {rule['alert']}"


def _commands(text: str) -> list[str]:
    return [c for c in re.findall(r"`((?:orbit-outbox|orbit-server) [^`]+)`", text)]


def _check_command(line: str) -> None:
    """The command and every --option of ``line`` exist in the real CLI."""
    words = shlex.split(line.replace("\\|", "|"))
    command: click.Command = {"orbit-outbox": outbox_cli, "orbit-server": server_cli}[words[0]]
    rest = words[1:]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        # get_command, not .commands: the server's groups are imported lazily (fast --help).
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"{line!r}: no command {rest[0]!r}"
        command, rest = sub, rest[1:]
    options = {opt for param in command.params for opt in param.opts}
    for word in rest:
        if word.startswith("--"):
            assert word in options, f"{line!r}: {command.name} has no option {word}"


@pytest.mark.parametrize(
    "where",
    ["docs", "alerts"],
)
def test_the_fix_commands_exist(where: str) -> None:
    if where == "docs":
        text = (REPO / "docs" / "reference" / "metrics-and-alerts.md").read_text()
    else:
        text = "\n".join(rule["annotations"]["description"] for rule in _alert_rules())
    commands = _commands(text)
    assert len(commands) >= 8
    for line in commands:
        _check_command(line)
