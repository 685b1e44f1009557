"""``orbit-server flow ...``: publish flow versions, start, signal, pause, resume and cancel instances,
and read their tokens, steps and history, on the database directly (like the other admin commands;
README "Flows: client and CLI").

Each command runs the same function as the API (:mod:`orbit_server.flows.admin`), in its own
transaction; changes are audited with actor ``orbit-server cli`` (pause, resume and cancel:
``cli:<login name> (orbit-server cli)``, or ``--actor`` / ``ORBIT_ADMIN_ACTOR`` instead of the login).
Listings print a rich table on a terminal, tab-separated lines when piped, JSON with ``--json``
(the API's wire shapes). Exit codes as for every ``orbit-server`` command: 0 done, 1 refused
(unknown flow, version or instance, a finished instance, a key already used for another
request), 2 bad usage (e.g. an invalid graph: the message names the node), 3 the database is
unreachable.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel, ValidationError

from orbit_client import (
    NAME_PATTERN,
    FlowControl,
    FlowInstance,
    FlowInstanceStatus,
    FlowPublish,
    FlowSignal,
    FlowStart,
    SignalNode,
    is_valid_idempotency_key,
)
from orbit_client._problems import readable_errors
from orbit_server.cli.options import (
    _actor,
    _actor_option,
    _cell,
    _database_url_option,
    _engine,
    _json_option,
    _print_json,
    _table,
)
from orbit_server.flows import admin as flow_admin
from orbit_server.flows import store as flow_store
from orbit_server.settings import ServerSettings

__all__ = ["flow"]


# ------------------------------------------------------------------ input


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in readable_errors(exc.errors())
    )


def _json_value(text: str, param_hint: str) -> Any:
    """``text`` as JSON; ``@FILE`` reads FILE, ``@-`` standard input."""
    if text.startswith("@"):
        name = text[1:]
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {name}: {exc.strerror}", param_hint=param_hint) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=param_hint) from None


def _model(model: type[BaseModel], what: str, **fields: Any) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        raise click.UsageError(f"invalid {what}: {_problems(exc)}") from None


def _key(key: str, param_hint: str = "--key") -> str:
    if not is_valid_idempotency_key(key):
        raise click.BadParameter(
            "1-255 printable ASCII characters without leading or trailing spaces", param_hint=param_hint
        )
    return key


def _flow_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A flow name as the API takes it in its path (the pattern of queue names), else bad usage."""
    if value is not None and re.fullmatch(NAME_PATTERN, value) is None:
        raise click.BadParameter(
            f"{value!r} is not a flow name: 1-64 characters, letters, digits, '.', '_' and '-', "
            "starting with a letter or digit",
            ctx=ctx, param=param,
        )  # fmt: skip
    return value


def _settings(database_url: str) -> Any:
    """What step tasks inherit (max attempts, key window): the server's settings, read from ORBIT_*."""
    try:
        return flow_admin.engine_settings(ServerSettings(database_url=database_url))
    except ValidationError as exc:
        raise click.UsageError(f"the server settings (ORBIT_*) are invalid: {_problems(exc)}") from None


_namespace_option = click.option(
    "--namespace", "namespace_name", envvar="ORBIT_NAMESPACE", show_envvar=True, required=True,
    help="The namespace.",
)  # fmt: skip


# ----------------------------------------------------------------- output


def _when(value: Any) -> str:
    return _cell(value)


def _where(instance: FlowInstance) -> str:
    """The nodes its live tokens are on, with what they wait for."""
    parts = []
    for token in instance.tokens:
        if token.state.value in ("ACTIVE", "WAITING"):
            parts.append(token.node + (f" ({token.waiting_for})" if token.waiting_for else ""))
    return ", ".join(parts)


def _instance_rows(items: Sequence[FlowInstance]) -> None:
    _table(
        ["id", "namespace", "flow", "version", "status", "where", "pending", "created (UTC)", "finished (UTC)"],
        [
            [i.id, i.namespace, i.flow, i.version, i.status, _where(i), i.pending_events or "", i.created_at,
             i.finished_at]
            for i in items
        ],
    )  # fmt: skip


def _short(value: Any) -> str:
    if value is None:
        return ""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= 80 else text[:79] + "…"


def _show(instance: FlowInstance) -> None:
    i = instance
    pending = ""
    if i.pending_events:
        pending = f"{i.pending_events} task result(s) recorded, not applied yet" + (
            " (applied on resume)" if i.paused else ""
        )
    facts = [
        ("id", i.id),
        ("namespace", i.namespace),
        ("flow", f"{i.flow} version {i.version}"),
        ("status", i.status.value),
        ("pending", pending),
        ("idempotency key", i.idempotency_key or ""),
        ("control version", str(i.control_version)),
        ("state version", str(i.state_version)),
        ("created", _when(i.created_at)),
        ("updated", _when(i.updated_at)),
        ("finished", _when(i.finished_at)),
    ]
    for name, value in facts:
        if value:
            click.echo(f"{name}:\t{value}")
    click.echo("input:")
    click.echo(json.dumps(i.input, indent=2, ensure_ascii=False))
    if i.output is not None:
        click.echo("output:")
        click.echo(json.dumps(i.output, indent=2, ensure_ascii=False))
    if i.error is not None:
        click.echo("error:")
        click.echo(json.dumps(i.error, indent=2, ensure_ascii=False))
    click.echo("")
    _table(
        ["token id", "node", "state", "activation", "waiting for", "fires at (UTC)", "parent id", "task id"],
        [
            [t.id, t.node, t.state, t.activation, t.waiting_for, t.fire_at, t.parent_id, t.task_id]
            for t in i.tokens
        ],
        title="tokens",
    )
    click.echo("")
    _table(
        ["node", "activation", "round", "task id", "status", "created (UTC)", "finished (UTC)", "result or error"],
        [
            [s.node, s.activation, s.round, s.task_id, s.status, s.created_at, s.finished_at,
             _short(s.error if s.error is not None else s.result)]
            for s in i.steps
        ],
        title="steps",
    )  # fmt: skip


def _history_rows(entries: Sequence[Any]) -> None:
    _table(
        ["at (UTC)", "event", "node", "activation", "from", "to", "actor", "data"],
        [
            [e.at, e.event, e.node, e.activation, e.from_state, e.to_state, e.actor, _short(e.data)]
            for e in entries
        ],
    )


# ---------------------------------------------------------------- commands


@click.group()
def flow() -> None:
    """Publish flows and run, signal, pause, resume and cancel their instances (README "Flows")."""


@flow.command("publish")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--flow", "name", required=True, callback=_flow_name,
              help="The flow's name (created with its first version).")  # fmt: skip
@click.option("--description", default=None, help="A note stored with the version.")
@_namespace_option
@_json_option
@_database_url_option
def flow_publish(
    file: str, name: str, description: str | None, namespace_name: str, as_json: bool, database_url: str
) -> None:
    """Publish FILE (a flow graph as JSON; - for standard input) as the next version of flow --flow.

    The graph is checked first (the message names the node). Publishing a graph identical to an
    existing version creates nothing and prints that version's number.
    """
    graph = _json_value(f"@{file}", "FILE")
    fields: dict[str, Any] = {"graph": graph} | ({"description": description} if description else {})
    body = _model(FlowPublish, "flow graph", **fields)
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            principal = flow_admin.cli_principal(conn, namespace_name)
        version, created = flow_admin.publish(engine, principal, name, body)
        with engine.connect() as conn:
            missing = flow_admin.missing_queues(conn, principal, body.graph)
    what = "published as" if created else "unchanged: the same graph is"
    click.echo(f"flow {name!r} {what} version {version.version} (digest {version.digest[:12]})", err=True)
    for queue, nodes in missing.items():
        click.echo(
            f"warning: queue {queue!r} (node{'s' if len(nodes) > 1 else ''} {', '.join(map(repr, nodes))}) "
            f"does not exist in namespace "
            f"{namespace_name!r}: an instance that reaches it fails with queue_not_found; create it with "
            f"`orbit-server queue create {namespace_name} {queue}`",
            err=True,
        )
    if as_json:
        _print_json(version)
    else:
        click.echo(version.version)


@flow.command("list")
@_namespace_option
@_json_option
@_database_url_option
def flow_list(namespace_name: str, as_json: bool, database_url: str) -> None:
    """List the namespace's flows, by name, with their newest version."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = flow_store.list_flows(conn, flow_admin.cli_principal(conn, namespace_name))
    if as_json:
        _print_json(found)
        return
    _table(
        ["flow", "newest version", "created (UTC)", "updated (UTC)"],
        [[f.name, f.latest_version, f.created_at, f.updated_at] for f in found],
    )


@flow.command("versions")
@click.argument("name", metavar="NAME", callback=_flow_name)
@_namespace_option
@_json_option
@_database_url_option
def flow_versions(name: str, namespace_name: str, as_json: bool, database_url: str) -> None:
    """List the versions of flow NAME, newest first (with --json: their graphs too)."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = flow_store.list_versions(conn, flow_admin.cli_principal(conn, namespace_name), name)
    if as_json:
        _print_json(found)
        return
    _table(
        ["version", "digest", "nodes", "published (UTC)", "by", "description"],
        [[v.version, v.digest[:12], len(v.graph.nodes), v.published_at, v.published_by, v.description]
         for v in found],
    )  # fmt: skip


@flow.command("start")
@click.argument("name", metavar="NAME", callback=_flow_name)
@click.option("--input", "input_json", default="{}", show_default=True,
              help="The instance's input: a JSON object, or @FILE (@- for standard input).")  # fmt: skip
@click.option("--key", "idempotency_key", required=True,
              help="Idempotency key: one instance per key, however often the command runs.")  # fmt: skip
@click.option("--version", type=click.IntRange(min=1), default=None, help="Flow version; default the newest.")
@_namespace_option
@_json_option
@_database_url_option
def flow_start(
    name: str, input_json: str, idempotency_key: str, version: int | None, namespace_name: str, as_json: bool,
    database_url: str,
) -> None:  # fmt: skip
    """Start an instance of flow NAME once per --key; prints its id (a repeat prints the same id)."""
    fields: dict[str, Any] = {"input": _json_value(input_json, "--input")}
    if version is not None:
        fields["version"] = version
    body = _model(FlowStart, "flow start", **fields)
    key = _key(idempotency_key)
    settings = _settings(database_url)
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            principal = flow_admin.cli_principal(conn, namespace_name)
        instance, replayed = flow_admin.start(engine, principal, name, body, key, settings)
    how = "already started with this key" if replayed else "started"
    why = ""  # an instance that failed at once (e.g. a path its input lacks): say why, not only FAILED
    if isinstance(instance.error, dict) and instance.error.get("message"):
        why = f" ({instance.error.get('code')}: {instance.error['message']})"
    click.echo(
        f"flow {name!r} version {instance.version}: instance {how}, {instance.status.value}{why}", err=True
    )
    if as_json:
        _print_json(instance)
    else:
        click.echo(instance.id)


@flow.command("instances")
@_namespace_option
@click.option("--flow", "flow_name", default=None, help="Only this flow.")
@click.option(
    "--status", type=click.Choice([s.value for s in FlowInstanceStatus], case_sensitive=False), default=None
)
@click.option(
    "--key", "idempotency_key", default=None, help="Only the instance this idempotency key started."
)
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@click.option("--cursor", default=None, help="The cursor printed under the previous page.")
@_json_option
@_database_url_option
def flow_instances(
    namespace_name: str, flow_name: str | None, status: str | None, idempotency_key: str | None, limit: int,
    cursor: str | None, as_json: bool, database_url: str,
) -> None:  # fmt: skip
    """List the namespace's flow instances, newest first, with the nodes their tokens are on."""
    with _engine(database_url) as engine, engine.begin() as conn:
        page = flow_store.list_instances(
            conn, flow_admin.cli_principal(conn, namespace_name), flow=flow_name,
            status=FlowInstanceStatus(status.upper()) if status else None, idempotency_key=idempotency_key,
            cursor=cursor, limit=limit,
        )  # fmt: skip
    if as_json:
        _print_json(page)
        return
    _instance_rows(page.items)
    if page.next_cursor:
        click.echo(f"more: --cursor {page.next_cursor}", err=True)


@flow.command("show")
@click.argument("instance_id", metavar="ID")
@_json_option
@_database_url_option
def flow_show(instance_id: str, as_json: bool, database_url: str) -> None:
    """Show instance ID: status, input, output or error, its tokens and its steps (with their tasks)."""
    with _engine(database_url) as engine, engine.begin() as conn:
        instance = flow_store.get_instance(
            conn, flow_admin.instance_principal(conn, instance_id), instance_id
        )
    if as_json:
        _print_json(instance)
        return
    _show(instance)


@flow.command("history")
@click.argument("instance_id", metavar="ID")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Most entries printed, oldest first.")  # fmt: skip
@_json_option
@_database_url_option
def flow_history(instance_id: str, limit: int, as_json: bool, database_url: str) -> None:
    """Print the history of instance ID, oldest first: every change of the instance and its tokens."""
    entries: list[Any] = []
    cursor: str | None = None
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            principal = flow_admin.instance_principal(conn, instance_id)
        while len(entries) < limit:
            with engine.begin() as conn:  # one short transaction a page
                page = flow_store.history(
                    conn, principal, instance_id, cursor=cursor, limit=min(1000, limit - len(entries))
                )
            entries.extend(page.items)
            cursor = page.next_cursor
            if cursor is None:
                break
    if as_json:
        _print_json({"items": entries, "next_cursor": cursor})
        return
    _history_rows(entries)
    if cursor:
        click.echo(f"more than {limit} entries: raise --limit", err=True)


@flow.command("signal")
@click.argument("instance_id", metavar="ID")
@click.argument("name", metavar="NAME")
@click.option("--key", "idempotency_key", required=True,
              help="The signal's identity in the instance: sending it again is a replay.")  # fmt: skip
@click.option("--payload", "payload_json", default=None, help="The signal's payload: JSON or @FILE.")
@_json_option
@_database_url_option
def flow_signal(
    instance_id: str,
    name: str,
    idempotency_key: str,
    payload_json: str | None,
    as_json: bool,
    database_url: str,
) -> None:
    """Send signal NAME to instance ID (buffered until a matching wait takes it); prints the signal's id."""
    fields: dict[str, Any] = {"name": name}
    if payload_json is not None:
        fields["payload"] = _json_value(payload_json, "--payload")
    body = _model(FlowSignal, "signal", **fields)
    key = _key(idempotency_key)
    settings = _settings(database_url)
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            principal = flow_admin.instance_principal(conn, instance_id)
        record, replayed = flow_admin.signal(engine, principal, instance_id, body, key, settings)
        waits: list[str] | None = None
        if not record.consumed_by_token:  # a typo'd name is buffered for ever: say so
            with engine.connect() as conn:
                instance = flow_store.get_instance(conn, principal, instance_id)
                graph = flow_store.get_version(conn, principal, instance.flow, instance.version).graph
            waits = sorted({n.signal for n in graph.nodes.values() if isinstance(n, SignalNode)})
    how = "already recorded with this key" if replayed else "recorded"
    taken = f", taken by token {record.consumed_by_token}" if record.consumed_by_token else ", buffered"
    click.echo(f"signal {name!r} {how} for instance {instance_id}{taken}", err=True)
    if waits is not None and name not in waits:
        click.echo(
            f"warning: no signal node of flow {instance.flow!r} version {instance.version} waits for {name!r} "
            f"(its signal nodes wait for: {', '.join(map(repr, waits)) or 'none'}); the signal stays recorded, "
            f"readable only as $.signals.{name}",
            err=True,
        )
    if as_json:
        _print_json(record)
    else:
        click.echo(record.id)


def _control_command(action: str, doc: str) -> Any:
    @flow.command(action, help=doc)
    @click.argument("instance_id", metavar="ID")
    @click.option("--reason", default=None, help="Why (kept in the instance's history).")
    @_actor_option
    @_json_option
    @_database_url_option
    def command(
        instance_id: str, reason: str | None, actor: str | None, as_json: bool, database_url: str
    ) -> None:
        body = _model(FlowControl, f"{action} request", reason=reason or None, actor=_actor(actor))
        settings = _settings(database_url)
        with _engine(database_url) as engine:
            with engine.begin() as conn:
                principal = flow_admin.instance_principal(conn, instance_id)
            instance = flow_admin.control_instance(engine, principal, instance_id, action, body, settings)
        if as_json:
            _print_json(instance)
            return
        click.echo(f"instance {instance.id} is {instance.status.value}", err=True)

    return command


flow_cancel = _control_command(
    "cancel", "Cancel instance ID: its tokens and timers end, its live step tasks get a cancel request."
)
flow_pause = _control_command(
    "pause", "Pause instance ID: no new task, timer or poll round; results in flight wait for the resume."
)
flow_resume = _control_command("resume", "Resume instance ID: pending results are applied, due timers fire.")
