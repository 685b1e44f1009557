"""Paths and templates of flow graphs, resolved against an instance's data (README "Flows: graph format").

No code is evaluated: a path is ``$`` and name/index segments (syntax checked when the graph is
published, :func:`orbit_client.parse_flow_path`), looked up in a :data:`Scope`::

    {"input": <the instance input>,
     "steps": {<node id>: {"status": <task status>, "result": ..., "error": ...}},   # newest finished step
     "signals": {<signal name>: <payload of the newest received signal of that name>},
     "instance": {"id": ..., "flow": ..., "version": ...}}

A template is any JSON value: a string starting with ``$.`` is replaced by the value at that path,
``{"$literal": X}`` by X unevaluated, objects and arrays are rendered item by item, anything else is
kept. A missing path raises :class:`PathMissing` (code ``flow_path_missing``), which fails the
instance with an error naming the node and the path.

Functions here are pure (no database, no clock) and safe to call from any thread.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict

from pydantic import TypeAdapter, ValidationError

from orbit_client import ChoiceNode, UTCDateTime, check_json_data, parse_flow_path

__all__ = [
    "FlowPathError",
    "PathMissing",
    "PathValueError",
    "Scope",
    "StepView",
    "choose",
    "is_present",
    "json_equal",
    "make_scope",
    "poll_done",
    "render",
    "render_concurrency_key",
    "resolve",
    "resolve_time",
]

_LITERAL = "$literal"
_TIME = TypeAdapter(UTCDateTime)
_CONCURRENCY_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


class StepView(TypedDict):
    """What ``$.steps.<node>`` shows of a node's newest finished step."""

    status: str
    result: Any
    error: Any


class Scope(TypedDict):
    """The data paths are resolved against (see the module docstring)."""

    input: Any
    steps: Mapping[str, StepView]
    signals: Mapping[str, Any]
    instance: Mapping[str, Any]


def make_scope(
    *,
    input: Any,
    instance_id: str,
    flow: str,
    version: int,
    steps: Mapping[str, StepView] | None = None,
    signals: Mapping[str, Any] | None = None,
) -> Scope:
    """Build a :class:`Scope`.

    Args:
        input: the instance's input (a JSON object).
        instance_id, flow, version: the instance's id, flow name and version number.
        steps: node id → its newest finished step (status, result, error); ``None``: no step yet.
        signals: signal name → payload of the newest received signal of that name (consumed or
            not); ``None``: none received.
    """
    return {
        "input": input,
        "steps": steps if steps is not None else {},
        "signals": signals if signals is not None else {},
        "instance": {"id": instance_id, "flow": flow, "version": version},
    }


class FlowPathError(Exception):
    """A path or template could not give a usable value; the instance fails with :meth:`as_error`.

    Attributes:
        code: stable and machine-readable (``flow_path_missing``, ``flow_path_invalid_value``).
        path: the path at fault; ``None`` when the whole rendered template is at fault.
        node: the node whose field it is, when the caller said (``None`` otherwise).
        message: for humans.
    """

    code = "flow_path_error"

    def __init__(self, message: str, *, path: str | None, node: str | None = None) -> None:
        self.message = message
        self.path = path
        self.node = node
        super().__init__(f"node {node!r}: {message}" if node is not None else message)

    def for_node(self, node: str) -> FlowPathError:
        """The same error naming ``node`` (a new exception of the same class)."""
        return type(self)(self.message, path=self.path, node=node)

    def as_error(self) -> dict[str, Any]:
        """The instance's ``error`` for this failure: ``{"code", "message", "node", "path"}``."""
        return {"code": self.code, "message": str(self), "node": self.node, "path": self.path}


class PathMissing(FlowPathError):
    """The path leads nowhere in the instance data: a missing key, an index out of range, a name
    applied to a non-object or an index to a non-array."""

    code = "flow_path_missing"


class PathValueError(FlowPathError):
    """The path resolves, but not to a value of the kind the field needs (a timer's ``until`` that
    is not an RFC 3339 time with an offset, a concurrency key that is not a string or an integer, a
    rendered template that is not storable JSON)."""

    code = "flow_path_invalid_value"


def _named(exc: FlowPathError, node: str | None) -> FlowPathError:
    return exc.for_node(node) if node is not None else exc


@functools.lru_cache(maxsize=4096)
def _segments(path: str) -> tuple[str | int, ...]:
    return parse_flow_path(path)


def _walk(path: str, scope: Mapping[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` at ``path``, or ``(False, description of where it stopped)``."""
    value: Any = scope
    walked = "$"
    for segment in _segments(path):
        if isinstance(segment, str):
            if not isinstance(value, Mapping) or segment not in value:
                if walked == "$.steps" and isinstance(value, Mapping):
                    return False, f"no step of node {segment!r} has finished"
                if walked == "$.signals" and isinstance(value, Mapping):
                    return False, f"no signal {segment!r} was received"
                kind = "an object" if isinstance(value, Mapping) else _kind(value)
                return False, f"{walked} is {kind} without {segment!r}"
            value = value[segment]
            walked += f".{segment}"
        else:
            if not isinstance(value, Sequence) or isinstance(value, str | bytes):
                return False, f"{walked} is {_kind(value)}, not an array"
            if segment >= len(value):
                return False, f"{walked} has {len(value)} items, no [{segment}]"
            value = value[segment]
            walked += f"[{segment}]"
    return True, value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    return "an array"


def resolve(path: str, scope: Mapping[str, Any]) -> Any:
    """The value at ``path`` in ``scope`` (JSON ``null`` is a value: it resolves to ``None``).

    Args:
        path: a path (``$.input.items[0].sku``); its syntax was checked when the graph was published.
        scope: a :class:`Scope` (or, for a poll's ``done_path``, ``{"result": <task result>}``).

    Returns:
        The value itself, not a copy: do not change it.

    Raises:
        PathMissing: the path leads nowhere; the message says where it stopped.
        ValueError: the path is malformed (a graph that did not pass validation).
    """
    found, value = _walk(path, scope)
    if not found:
        raise PathMissing(f"path {path} is missing: {value}", path=path)
    return value


def is_present(path: str, scope: Mapping[str, Any]) -> bool:
    """``True`` when ``path`` resolves in ``scope`` (to any value, ``null`` included)."""
    return _walk(path, scope)[0]


def render(template: Any, scope: Mapping[str, Any], *, node: str | None = None) -> Any:
    """Render a template against ``scope`` (rules in the module docstring).

    Args:
        template: JSON data from the graph (a task's ``params``, an end's ``output``).
        scope: a :class:`Scope`.
        node: the node the template belongs to, named in errors; ``None``: not named.

    Returns:
        New JSON data (objects and arrays are new; resolved values are shared with ``scope``).

    Raises:
        PathMissing: a path leads nowhere (code ``flow_path_missing``).
        PathValueError: the result is not JSON that Orbit stores (e.g. nested deeper than
            ``JSON_MAX_DEPTH`` once values were put in).
    """
    try:
        result = _render(template, scope)
    except FlowPathError as exc:
        raise _named(exc, node) from None
    try:
        check_json_data(result)
    except ValueError as exc:
        raise PathValueError(
            f"the rendered template is not storable JSON: {exc}", path=None, node=node
        ) from None
    return result


def _render(template: Any, scope: Mapping[str, Any]) -> Any:
    if isinstance(template, str):
        return resolve(template, scope) if template.startswith("$.") else template
    if isinstance(template, dict):
        if _LITERAL in template and len(template) == 1:
            return template[_LITERAL]
        return {key: _render(value, scope) for key, value in template.items()}
    if isinstance(template, list):
        return [_render(item, scope) for item in template]
    return template


def render_concurrency_key(
    template: str | None, scope: Mapping[str, Any], *, node: str | None = None
) -> str | None:
    """A task node's ``concurrency_key``: ``None`` stays ``None``; a string not starting with ``$.``
    is the key; a path gives the key from the instance data.

    Raises:
        PathMissing: the path leads nowhere.
        PathValueError: its value is not a string of 1-255 printable ASCII characters without
            spaces, nor an integer (written in decimal).
    """
    if template is None or not template.startswith("$."):
        return template
    try:
        value = resolve(template, scope)
    except FlowPathError as exc:
        raise _named(exc, node) from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and 1 <= len(value) <= 255 and set(value) <= _CONCURRENCY_KEY_CHARS:
        return value
    if isinstance(value, str):
        why = "a string that is not 1-255 printable ASCII characters without spaces"
    else:
        why = f"{_kind(value)}, not a string or an integer"
    raise PathValueError(f"concurrency_key {template} is {why}", path=template, node=node)


def resolve_time(path: str, scope: Mapping[str, Any], *, node: str | None = None) -> datetime:
    """A timer's ``until``: the RFC 3339 time (with an offset) at ``path``, in UTC.

    Raises:
        PathMissing: the path leads nowhere.
        PathValueError: the value is not an RFC 3339 string with an offset
            (``2026-01-01T00:00:00Z``, ``2026-01-01T01:00:00+01:00``).
    """
    try:
        value = resolve(path, scope)
    except FlowPathError as exc:
        raise _named(exc, node) from None
    if isinstance(value, str):
        try:
            return _TIME.validate_python(value)
        except ValidationError:
            pass
    raise PathValueError(
        f"path {path} is {_kind(value)}, not an RFC 3339 time with an offset (e.g. 2026-01-01T00:00:00Z)",
        path=path,
        node=node,
    )


def json_equal(left: Any, right: Any) -> bool:
    """JSON equality: numbers by value (``1`` equals ``1.0``), booleans only equal booleans (``true``
    is not ``1``), ``null`` only ``null``, objects by keys and values, arrays item by item."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    if isinstance(left, str) or isinstance(right, str):
        return isinstance(left, str) and isinstance(right, str) and left == right
    if left is None or right is None:
        return left is None and right is None
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(json_equal(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(json_equal(a, b) for a, b in zip(left, right, strict=True))
    return False


def choose(node: ChoiceNode, scope: Mapping[str, Any]) -> str:
    """The node a choice goes to: the ``next`` of its first matching rule, else its ``default``.

    An ``equals`` rule matches when its path resolves to a JSON-equal value (:func:`json_equal`;
    a missing path does not match); a ``present`` rule when :func:`is_present` equals ``present``.
    Never raises for missing paths.
    """
    for rule in node.rules:
        if rule.present is not None:
            if is_present(rule.path, scope) == rule.present:
                return rule.next
            continue
        found, value = _walk(rule.path, scope)
        if found and json_equal(value, rule.equals):
            return rule.next
    return node.default


def poll_done(done_path: str, result: Any) -> bool:
    """Whether a poll round is done: the value at ``done_path`` in ``{"result": result}`` is ``true``
    (the JSON boolean; ``1``, ``"true"`` or a missing path are not done)."""
    found, value = _walk(done_path, {"result": result})
    return found and value is True
