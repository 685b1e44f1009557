"""Validation errors in the words of the wire format, not of pydantic (one helper for the server's
422 bodies, the client's usage errors and the CLIs): no ``Value error,`` prefix, no union tag in a
location (``nodes.a.task.handler`` is ``nodes.a.handler`` in the graph a user wrote), and a wrong
node ``type`` said as such."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["readable_errors"]

#: The ``type`` of each flow node: pydantic puts it into an error's location after the node's id.
_NODE_TYPES = frozenset({"task", "timer", "signal", "parallel", "join", "poll", "choice", "end"})


def _loc(loc: Sequence[Any]) -> list[Any]:
    return [
        part for i, part in enumerate(loc) if not (i >= 2 and loc[i - 2] == "nodes" and part in _NODE_TYPES)
    ]


def _msg(error: Mapping[str, Any]) -> str:
    kind, context = error.get("type", ""), error.get("ctx") or {}
    if kind == "union_tag_invalid":
        return f"type {context.get('tag')!r} is not a node type; use one of {context.get('expected_tags')}"
    if kind == "union_tag_not_found":
        return "give the node's type"
    return str(error.get("msg", "")).removeprefix("Value error, ")


def readable_errors(errors: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``loc``, ``msg`` and ``type`` of each of pydantic's ``errors`` (``exc.errors()``), said as above;
    never the input (it may hold params)."""
    return [{"loc": _loc(e.get("loc", ())), "msg": _msg(e), "type": e.get("type", "")} for e in errors]
