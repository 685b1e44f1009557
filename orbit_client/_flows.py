"""Flow calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`:
publish flow versions, start instances, signal, pause, resume and cancel them, read their history.
README "Flows: client and CLI"; the wire shapes are in :mod:`orbit_client._flow_models`.

Request building and response parsing are module functions with no I/O, shared by the two
mixins; each mixin only sends (the layout of ``_client.py``, STYLE habit 5).

Which calls are retried by the client (``RetryPolicy``) and why:

- ``publish_flow``: publishing the identical graph again returns the existing version (same digest).
- ``start_flow`` and ``signal_flow``: every try carries the same ``Idempotency-Key``; a repeat is a replay.
- ``pause_flow_instance`` / ``resume_flow_instance``: idempotent on the server.
- ``cancel_flow_instance``: retried too; a retry after a cancel whose answer was lost gets ``409
  invalid_transition`` (the instance is finished), raised with ``outcome_known=False`` by the retry
  rule: fetch the instance to see that it is ``CANCELLED``.
- reads: always.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from ._calls import _key_headers
from ._exceptions import OrbitError, OrbitUsageError
from ._flow_graph import FlowGraph
from ._flow_models import (
    FlowControl,
    FlowHistoryPage,
    FlowInstance,
    FlowInstancePage,
    FlowInstanceStatus,
    FlowPublish,
    FlowSignal,
    FlowSignalRecord,
    FlowStart,
    FlowSummary,
    FlowVersion,
)
from ._models import NAME_PATTERN
from ._problems import readable_errors

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import httpx

__all__ = ["FlowSignalResult", "FlowStartResult"]

#: Most items a page may ask for (``limit``): instances (they carry tokens and steps), history entries.
_INSTANCES_MAX = 500
_HISTORY_MAX = 1000


class FlowStartResult(BaseModel):
    """What :meth:`OrbitClient.start_flow` returns.

    Attributes:
        instance: the instance the idempotency key names (on a replay, the one started first, as it is now).
        replayed: ``True`` when the server answered ``200``: an earlier start with this key and the
            same input and version already made the instance; ``False`` for a new one (``201``).
    """

    model_config = ConfigDict(frozen=True)

    instance: FlowInstance
    replayed: bool


class FlowSignalResult(BaseModel):
    """What :meth:`OrbitClient.signal_flow` returns.

    Attributes:
        signal: the recorded signal (on a replay, the one recorded first under this idempotency key).
        replayed: ``True`` when the server answered ``200`` (the same signal was recorded before).
    """

    model_config = ConfigDict(frozen=True)

    signal: FlowSignalRecord
    replayed: bool


# --- request building (no I/O) ----------------------------------------------------------------------


def _dump(model: type[BaseModel], what: str, **fields: Any) -> dict[str, Any]:
    """Validate ``fields`` as ``model``; the JSON body of the fields given (unset ones stay out).

    Raises :class:`OrbitUsageError` naming the bad fields, never their values (input may be secret).
    """
    try:
        value = model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in readable_errors(exc.errors())
        )
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {problems}") from None
    return value.model_dump(mode="json", exclude_unset=True)


def _flow_path(path: Callable[..., str], namespace: str, name: str, tail: str = "") -> str:
    """The flow's URL path; a name the server's route refuses (pattern of queue names) raises
    :class:`OrbitUsageError` here, nothing sent (a ``/`` in it would otherwise answer a bare 404)."""
    if not isinstance(name, str) or re.fullmatch(NAME_PATTERN, name) is None:
        raise OrbitUsageError(
            f"{name!r} is not a flow name: 1-64 characters, letters, digits, '.', '_' and '-', starting "
            "with a letter or digit; nothing was sent"
        )
    return path("/v1/namespaces/{}/flows/{}" + tail, namespace, name)


def _instance_path(path: Callable[..., str], namespace: str, instance_id: str, tail: str = "") -> str:
    return path("/v1/namespaces/{}/flow-instances/{}" + tail, namespace, instance_id)


def _check_version(version: int | None) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise OrbitUsageError(
            f"version is a flow version number (1, 2, ...), not {version!r}; nothing was sent"
        )


def _check_limit(limit: int, most: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise OrbitUsageError(f"limit must be between 1 and {most}, not {limit!r}; nothing was sent")


def _publish_body(graph: Any, description: str | None) -> dict[str, Any]:
    if isinstance(graph, FlowGraph):
        graph = graph.model_dump(mode="json", exclude_unset=True)
    elif not isinstance(graph, Mapping):
        raise OrbitUsageError(
            f"graph is a FlowGraph or a mapping of its fields, not a {type(graph).__name__}; nothing was sent"
        )
    fields: dict[str, Any] = {"graph": dict(graph)}
    if description is not None:
        fields["description"] = description
    return _dump(FlowPublish, "flow graph", **fields)


def _start_body(input: Mapping[str, Any] | None, version: int | None) -> dict[str, Any]:
    _check_version(version)
    if input is not None and not isinstance(input, Mapping):
        raise OrbitUsageError(
            f"input is a JSON object (a mapping), not a {type(input).__name__}; nothing was sent"
        )
    fields: dict[str, Any] = {"input": dict(input) if input is not None else {}}
    if version is not None:
        fields["version"] = version
    return _dump(FlowStart, "flow start", **fields)


def _signal_body(name: str, payload: JsonValue) -> dict[str, Any]:
    fields: dict[str, Any] = {"name": name}
    if payload is not None:
        fields["payload"] = payload
    return _dump(FlowSignal, "signal", **fields)


def _control_body(reason: str | None, actor: str | None) -> dict[str, Any]:
    fields = {k: v for k, v in (("reason", reason), ("actor", actor)) if v is not None}
    return _dump(FlowControl, "control request", **fields)


def _instance_params(
    flow: str | None,
    status: FlowInstanceStatus | str | None,
    idempotency_key: str | None,
    limit: int,
    cursor: str | None,
) -> dict[str, str]:
    _check_limit(limit, _INSTANCES_MAX)
    params = {"limit": str(limit)}
    if flow is not None:
        params["flow"] = flow
    if status is not None:
        try:
            params["status"] = FlowInstanceStatus(status).value
        except ValueError:
            choices = ", ".join(s.value for s in FlowInstanceStatus)
            raise OrbitUsageError(
                f"status must be one of {choices}, not {status!r}; nothing was sent"
            ) from None
    if idempotency_key is not None:
        params["idempotency_key"] = idempotency_key
    if cursor is not None:
        params["cursor"] = cursor
    return params


def _page_params(limit: int, cursor: str | None) -> dict[str, str]:
    _check_limit(limit, _HISTORY_MAX)
    return {"limit": str(limit)} | ({"cursor": cursor} if cursor is not None else {})


def _replayed(response: httpx.Response) -> bool:
    """201 is new; 200 a replay (the server may also say ``Idempotent-Replayed: true``)."""
    return response.status_code == 200


def _start_note(error: OrbitError, namespace: str, idempotency_key: str) -> None:
    """Say how to settle an unknown start: the task hint names ``find_submission()``, flows differ."""
    if not error.outcome_known:
        error.add_note(
            "the flow instance may have been started: call start_flow again with the same idempotency key "
            f"(a replay answers the existing instance) or find_flow_instance({namespace!r}, {idempotency_key!r})"
        )


def _signal_note(error: OrbitError) -> None:
    if not error.outcome_known:
        error.add_note(
            "the signal may have been recorded: send it again with the same idempotency key "
            "(a replay answers the recorded signal, never a second one)"
        )


# --- the mixins ---------------------------------------------------------------------------------------


class FlowMixin:
    """The flow calls of :class:`~orbit_client.OrbitClient` (README "Flows: client and CLI")."""

    if TYPE_CHECKING:
        _request: Callable[..., httpx.Response]
        _path: Callable[..., str]
        _parse_model: Callable[..., Any]
        _parse_list: Callable[..., Any]

    def publish_flow(
        self,
        namespace: str,
        name: str,
        graph: FlowGraph | Mapping[str, Any],
        *,
        description: str | None = None,
    ) -> FlowVersion:
        """Publish a version of flow ``name`` (``POST .../flows/{name}/versions``; ``submit`` key or above).

        Versions are immutable and numbered 1, 2, ... per flow; running instances keep theirs.
        Publishing a graph identical to an existing version of the flow (same digest of its canonical
        JSON) creates nothing and returns that version, so the call is retried on retryable errors.

        Args:
            name: the flow's name (pattern of queue names), created with its first version.
            graph: a :class:`FlowGraph` or a mapping of its fields (``{"start": ..., "nodes": {...}}``;
                README "Flows: graph format"); validated here before anything is sent.
            description: a note stored with the version; ``None`` means none.

        Returns:
            The new version, or the existing identical one.

        Raises:
            OrbitUsageError: the graph is invalid (the message names the node); nothing was sent.
            UnprocessableEntityError: the server refused the graph (422, e.g. a newer rule).
            OrbitError: as for every call.
        """
        path = _flow_path(self._path, namespace, name, "/versions")
        body = _publish_body(graph, description)
        return self._parse_model(FlowVersion, self._request("POST", path, json=body))  # type: ignore[no-any-return]

    def list_flows(self, namespace: str) -> list[FlowSummary]:
        """The namespace's flows with their newest version number (``GET .../flows``)."""
        path = self._path("/v1/namespaces/{}/flows", namespace)
        return self._parse_list(FlowSummary, self._request("GET", path))  # type: ignore[no-any-return]

    def list_flow_versions(self, namespace: str, name: str) -> list[FlowVersion]:
        """A flow's versions, newest first (``GET .../flows/{name}/versions``).

        Raises:
            NotFoundError: ``flow_not_found``. OrbitError: as for every call.
        """
        path = _flow_path(self._path, namespace, name, "/versions")
        return self._parse_list(FlowVersion, self._request("GET", path))  # type: ignore[no-any-return]

    def get_flow_version(self, namespace: str, name: str, version: int) -> FlowVersion:
        """One version of a flow with its graph (``GET .../flows/{name}/versions/{version}``).

        Raises:
            OrbitUsageError: ``version`` is not a positive integer; nothing was sent.
            NotFoundError: ``flow_not_found`` or ``flow_version_not_found``. OrbitError: as for every call.
        """
        _check_version(version)
        path = _flow_path(self._path, namespace, name, f"/versions/{version}")
        return self._parse_model(FlowVersion, self._request("GET", path))  # type: ignore[no-any-return]

    def start_flow(
        self,
        namespace: str,
        name: str,
        input: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str,
        version: int | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> FlowStartResult:
        """Start an instance of flow ``name``, at most once per idempotency key
        (``POST .../flows/{name}/instances``; ``submit`` key or above).

        The instance is bound to ``version`` (``None``: the newest version now) for its whole life.
        Retried on retryable errors: safe, because every try carries the same ``Idempotency-Key``.

        Args:
            input: the instance's input, a JSON object (``$.input`` in the graph's paths);
                ``None`` means ``{}``.
            idempotency_key: 1-255 printable ASCII characters naming this start; reuse it, and only
                it, when sending the same start again.
            version: the flow version to run; ``None`` means the newest.
            traceparent, tracestate: W3C Trace Context for the instance, as for
                :meth:`~orbit_client.OrbitClient.submit_task`; ``None`` means the active span's, if any.

        Returns:
            The instance and whether the answer was a replay of an earlier start with this key.

        Raises:
            OrbitUsageError: malformed key, version or input; nothing was sent.
            NotFoundError: ``flow_not_found`` or ``flow_version_not_found``; nothing was started.
            IdempotencyConflictError: the key already started an instance with another input or
                version (409 ``idempotency_conflict``); nothing was started.
            OrbitOutcomeUnknownError, ServerError: the instance may exist: call again with the same key
                (a replay answers it) or :meth:`find_flow_instance`.
            OrbitError: as for every call.
        """
        path = _flow_path(self._path, namespace, name, "/instances")
        body = _start_body(input, version)
        headers = _key_headers(idempotency_key, traceparent, tracestate, trace=True)
        try:
            response = self._request("POST", path, json=body, headers=headers)
        except OrbitError as exc:
            _start_note(exc, namespace, idempotency_key)
            raise
        return FlowStartResult(
            instance=self._parse_model(FlowInstance, response), replayed=_replayed(response)
        )

    def find_flow_instance(self, namespace: str, idempotency_key: str) -> FlowInstance | None:
        """The instance an idempotency key started, or ``None`` if none (``GET .../flow-instances
        ?idempotency_key=``). This settles a start whose outcome is unknown.

        Raises:
            OrbitUsageError: malformed key; nothing was sent. OrbitError: as for every call.
        """
        _key_headers(idempotency_key)  # checks the key
        path = self._path("/v1/namespaces/{}/flow-instances", namespace)
        params = _instance_params(None, None, idempotency_key, 1, None)
        page: FlowInstancePage = self._parse_model(
            FlowInstancePage, self._request("GET", path, params=params)
        )
        return page.items[0] if page.items else None

    def signal_flow(
        self,
        namespace: str,
        instance_id: str,
        name: str,
        payload: JsonValue = None,
        *,
        idempotency_key: str,
    ) -> FlowSignalResult:
        """Send signal ``name`` to an instance (``POST .../flow-instances/{id}/signals``; ``submit`` key or above).

        Signals are buffered: one received before its ``signal`` node is reached is consumed by the
        first matching wait that starts later; one that arrives after its wait timed out stays
        recorded, unconsumed. Retried on retryable errors: the key is the signal's identity in the
        instance, so a repeat is a replay, never a second signal.

        Args:
            name: the signal's name (``^[a-z][a-z0-9_.-]{0,63}$``), as in the graph's ``signal`` nodes.
            payload: any JSON value (``$.signals.<name>`` in the graph's paths); ``None`` means none.
            idempotency_key: 1-255 printable ASCII characters naming this signal.

        Returns:
            The recorded signal and whether the answer was a replay.

        Raises:
            OrbitUsageError: malformed key or name; nothing was sent.
            NotFoundError: no such instance.
            IdempotencyConflictError: the key already names another signal of this instance (409).
            InvalidTransitionError: the instance is finished (409 ``invalid_transition``).
            OrbitOutcomeUnknownError, ServerError: the signal may be recorded: send it again, same key.
            OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id, "/signals")
        body = _signal_body(name, payload)
        headers = _key_headers(idempotency_key)
        try:
            response = self._request("POST", path, json=body, headers=headers)
        except OrbitError as exc:
            _signal_note(exc)
            raise
        return FlowSignalResult(
            signal=self._parse_model(FlowSignalRecord, response), replayed=_replayed(response)
        )

    def get_flow_instance(self, namespace: str, instance_id: str) -> FlowInstance:
        """An instance with its tokens and steps (``GET .../flow-instances/{id}``).

        ``pending_events`` counts task results recorded but not yet applied by the engine ("the task
        has a result, the flow has not advanced yet"; while paused they wait for the resume).

        Raises:
            NotFoundError: no such instance in this namespace. OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id)
        return self._parse_model(FlowInstance, self._request("GET", path))  # type: ignore[no-any-return]

    def list_flow_instances(
        self,
        namespace: str,
        *,
        flow: str | None = None,
        status: FlowInstanceStatus | str | None = None,
        idempotency_key: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> FlowInstancePage:
        """A page of the namespace's instances, newest first, each with its tokens and steps
        (``GET .../flow-instances``).

        Args:
            flow, status, idempotency_key: filters; ``None`` means any.
            limit: most instances on the page, 1-500. Default 50 (the server's default).
            cursor: the previous page's ``next_cursor``; ``None`` starts at the newest.

        Returns:
            The page; its ``next_cursor`` is ``None`` on the last one.
        """
        path = self._path("/v1/namespaces/{}/flow-instances", namespace)
        params = _instance_params(flow, status, idempotency_key, limit, cursor)
        return self._parse_model(FlowInstancePage, self._request("GET", path, params=params))  # type: ignore[no-any-return]

    def get_flow_history(
        self, namespace: str, instance_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> FlowHistoryPage:
        """A page of an instance's history, oldest first (``GET .../flow-instances/{id}/history``).

        Every token and instance change is one entry, written in the transaction of the change.
        ``limit`` 1-1000 (default 100); ``cursor`` is the previous page's ``next_cursor``.

        Raises:
            NotFoundError: no such instance. OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id, "/history")
        return self._parse_model(  # type: ignore[no-any-return]
            FlowHistoryPage, self._request("GET", path, params=_page_params(limit, cursor))
        )

    def cancel_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Cancel an instance (``admin`` key): it becomes ``CANCELLED`` with its tokens and pending
        timers, and its live step tasks get a cancel request, in one transaction; audited.

        Args:
            reason, actor: kept in the instance's history (why; the person acting).

        Raises:
            InvalidTransitionError: the instance is finished (``COMPLETED``, ``FAILED``, ``CANCELLED``).
            NotFoundError: no such instance. OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id, "/cancel")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, self._request("POST", path, json=body))  # type: ignore[no-any-return]

    def pause_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Pause an instance (``admin`` key; idempotent, retried): it starts no task, timer or poll round;
        tasks in flight finish and their results wait (``pending_events``) until the resume. Audited.

        Raises:
            InvalidTransitionError: the instance is finished. OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id, "/pause")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, self._request("POST", path, json=body))  # type: ignore[no-any-return]

    def resume_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Resume a paused instance (``admin`` key; idempotent, retried): pending results are applied and
        timers that fell due meanwhile fire. Audited.

        Raises:
            InvalidTransitionError: the instance is finished. OrbitError: as for every call.
        """
        path = _instance_path(self._path, namespace, instance_id, "/resume")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, self._request("POST", path, json=body))  # type: ignore[no-any-return]


class AsyncFlowMixin:
    """The async twins, for :class:`~orbit_client.AsyncOrbitClient`."""

    if TYPE_CHECKING:
        _request: Callable[..., Awaitable[httpx.Response]]
        _path: Callable[..., str]
        _parse_model: Callable[..., Any]
        _parse_list: Callable[..., Any]

    async def publish_flow(
        self,
        namespace: str,
        name: str,
        graph: FlowGraph | Mapping[str, Any],
        *,
        description: str | None = None,
    ) -> FlowVersion:
        """Async twin of :meth:`OrbitClient.publish_flow`."""
        path = _flow_path(self._path, namespace, name, "/versions")
        body = _publish_body(graph, description)
        return self._parse_model(FlowVersion, await self._request("POST", path, json=body))  # type: ignore[no-any-return]

    async def list_flows(self, namespace: str) -> list[FlowSummary]:
        """Async twin of :meth:`OrbitClient.list_flows`."""
        path = self._path("/v1/namespaces/{}/flows", namespace)
        return self._parse_list(FlowSummary, await self._request("GET", path))  # type: ignore[no-any-return]

    async def list_flow_versions(self, namespace: str, name: str) -> list[FlowVersion]:
        """Async twin of :meth:`OrbitClient.list_flow_versions`."""
        path = _flow_path(self._path, namespace, name, "/versions")
        return self._parse_list(FlowVersion, await self._request("GET", path))  # type: ignore[no-any-return]

    async def get_flow_version(self, namespace: str, name: str, version: int) -> FlowVersion:
        """Async twin of :meth:`OrbitClient.get_flow_version`."""
        _check_version(version)
        path = _flow_path(self._path, namespace, name, f"/versions/{version}")
        return self._parse_model(FlowVersion, await self._request("GET", path))  # type: ignore[no-any-return]

    async def start_flow(
        self,
        namespace: str,
        name: str,
        input: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str,
        version: int | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> FlowStartResult:
        """Async twin of :meth:`OrbitClient.start_flow`."""
        path = _flow_path(self._path, namespace, name, "/instances")
        body = _start_body(input, version)
        headers = _key_headers(idempotency_key, traceparent, tracestate, trace=True)
        try:
            response = await self._request("POST", path, json=body, headers=headers)
        except OrbitError as exc:
            _start_note(exc, namespace, idempotency_key)
            raise
        return FlowStartResult(
            instance=self._parse_model(FlowInstance, response), replayed=_replayed(response)
        )

    async def find_flow_instance(self, namespace: str, idempotency_key: str) -> FlowInstance | None:
        """Async twin of :meth:`OrbitClient.find_flow_instance`."""
        _key_headers(idempotency_key)
        path = self._path("/v1/namespaces/{}/flow-instances", namespace)
        params = _instance_params(None, None, idempotency_key, 1, None)
        page: FlowInstancePage = self._parse_model(
            FlowInstancePage, await self._request("GET", path, params=params)
        )
        return page.items[0] if page.items else None

    async def signal_flow(
        self,
        namespace: str,
        instance_id: str,
        name: str,
        payload: JsonValue = None,
        *,
        idempotency_key: str,
    ) -> FlowSignalResult:
        """Async twin of :meth:`OrbitClient.signal_flow`."""
        path = _instance_path(self._path, namespace, instance_id, "/signals")
        body = _signal_body(name, payload)
        headers = _key_headers(idempotency_key)
        try:
            response = await self._request("POST", path, json=body, headers=headers)
        except OrbitError as exc:
            _signal_note(exc)
            raise
        return FlowSignalResult(
            signal=self._parse_model(FlowSignalRecord, response), replayed=_replayed(response)
        )

    async def get_flow_instance(self, namespace: str, instance_id: str) -> FlowInstance:
        """Async twin of :meth:`OrbitClient.get_flow_instance`."""
        path = _instance_path(self._path, namespace, instance_id)
        return self._parse_model(FlowInstance, await self._request("GET", path))  # type: ignore[no-any-return]

    async def list_flow_instances(
        self,
        namespace: str,
        *,
        flow: str | None = None,
        status: FlowInstanceStatus | str | None = None,
        idempotency_key: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> FlowInstancePage:
        """Async twin of :meth:`OrbitClient.list_flow_instances`."""
        path = self._path("/v1/namespaces/{}/flow-instances", namespace)
        params = _instance_params(flow, status, idempotency_key, limit, cursor)
        return self._parse_model(FlowInstancePage, await self._request("GET", path, params=params))  # type: ignore[no-any-return]

    async def get_flow_history(
        self, namespace: str, instance_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> FlowHistoryPage:
        """Async twin of :meth:`OrbitClient.get_flow_history`."""
        path = _instance_path(self._path, namespace, instance_id, "/history")
        return self._parse_model(  # type: ignore[no-any-return]
            FlowHistoryPage, await self._request("GET", path, params=_page_params(limit, cursor))
        )

    async def cancel_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Async twin of :meth:`OrbitClient.cancel_flow_instance`."""
        path = _instance_path(self._path, namespace, instance_id, "/cancel")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, await self._request("POST", path, json=body))  # type: ignore[no-any-return]

    async def pause_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Async twin of :meth:`OrbitClient.pause_flow_instance`."""
        path = _instance_path(self._path, namespace, instance_id, "/pause")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, await self._request("POST", path, json=body))  # type: ignore[no-any-return]

    async def resume_flow_instance(
        self, namespace: str, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> FlowInstance:
        """Async twin of :meth:`OrbitClient.resume_flow_instance`."""
        path = _instance_path(self._path, namespace, instance_id, "/resume")
        body = _control_body(reason, actor)
        return self._parse_model(FlowInstance, await self._request("POST", path, json=body))  # type: ignore[no-any-return]
