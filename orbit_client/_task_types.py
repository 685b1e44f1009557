"""Typed task definitions (README "Typed tasks"): a task declared once, its handler name, queue,
options and a pydantic model of its params, used by the submitting side and by the worker alike.

::

    class FulfilParams(BaseModel):
        order_id: int

    FULFIL = TaskDefinition("orders.fulfil", FulfilParams, queue="fulfilment", options={"retry_safe": True})

    FULFIL.submit(client, "shop", FulfilParams(order_id=42), idempotency_key=key)   # or a dict
    enqueue(conn, namespace="shop", task=FULFIL, params={"order_id": 42})          # outbox_adapter

    def fulfil(ctx: TaskContext, params: FulfilParams) -> dict: ...
    Worker(client, "shop", "fulfilment", {FULFIL.handler: FULFIL.handle(fulfil)})

Wrong params fail where they are given (``OrbitUsageError`` naming each field, nothing sent or
written); the handler receives the model. Plain string handlers keep working beside them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from orbit_client._exceptions import OrbitUsageError
from orbit_client._task_models import SubmitOptions, SubmitResult, TaskSubmission
from orbit_client._worker import TaskContext

if TYPE_CHECKING:
    from orbit_client._client import OrbitClient

__all__ = ["TaskDefinition"]

ParamsT = TypeVar("ParamsT", bound=BaseModel)


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False)
    )


class TaskDefinition(Generic[ParamsT]):
    """One task type: handler name, queue, submit options and the pydantic model of its params.

    Args:
        handler: the handler name workers dispatch on (1-255 printable ASCII), e.g. ``"orders.fulfil"``.
        params: a pydantic ``BaseModel`` subclass; params are validated against it when submitted or
            enqueued, and the worker's handler receives an instance of it.
        queue: the queue tasks of this type go to unless the caller names another. Default ``"default"``.
        options: :class:`SubmitOptions` (or a mapping of its fields) every task of this type gets;
            options given at submission override them field by field.

    Raises:
        OrbitUsageError: an invalid handler, queue or options, or ``params`` is not a model class.
    """

    __slots__ = ("handler", "options", "params_model", "queue")

    def __init__(
        self,
        handler: str,
        params: type[ParamsT],
        *,
        queue: str = "default",
        options: SubmitOptions | Mapping[str, Any] | None = None,
    ) -> None:
        if not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise OrbitUsageError(f"params must be a pydantic BaseModel subclass, not {params!r}")
        try:
            if options is not None and not isinstance(options, SubmitOptions):
                options = SubmitOptions.model_validate(dict(options))
            TaskSubmission(queue=queue, handler=handler, params=None, options=options)
        except ValidationError as exc:
            raise OrbitUsageError(f"invalid task definition {handler!r}: {_problems(exc)}") from None
        self.handler = handler
        self.params_model: type[ParamsT] = params
        self.queue = queue
        self.options: SubmitOptions | None = options

    def __repr__(self) -> str:
        return f"TaskDefinition({self.handler!r}, {self.params_model.__name__}, queue={self.queue!r})"

    def parse(self, params: ParamsT | Mapping[str, Any] | Any) -> ParamsT:
        """``params`` as the model: an instance is checked again (it may have been changed), a
        mapping (or any JSON value) validated.

        Raises:
            OrbitUsageError: the params do not match the model; the message names each field.
        """
        try:
            source = params.model_dump() if isinstance(params, BaseModel) else params
            return self.params_model.model_validate(source)
        except ValidationError as exc:
            raise OrbitUsageError(
                f"params of task {self.handler!r} do not match {self.params_model.__name__}: {_problems(exc)}"
            ) from None

    def dump(self, params: ParamsT | Mapping[str, Any]) -> Any:
        """The validated params as the JSON data the task carries (``model_dump(mode="json")``).

        Raises:
            OrbitUsageError: the params do not match the model.
        """
        return self.parse(params).model_dump(mode="json")

    def merged_options(self, options: SubmitOptions | Mapping[str, Any] | None) -> SubmitOptions | None:
        """This type's options with ``options`` over them, field by field (``None``: this type's).

        Raises:
            OrbitUsageError: ``options`` are invalid.
        """
        if options is None:
            return self.options
        try:
            given = (
                options if isinstance(options, SubmitOptions) else SubmitOptions.model_validate(dict(options))
            )
        except ValidationError as exc:
            raise OrbitUsageError(f"invalid options: {_problems(exc)}") from None
        if self.options is None:
            return given
        return self.options.model_copy(update=given.model_dump(exclude_unset=True))

    def submit(
        self,
        client: OrbitClient,
        namespace: str,
        params: ParamsT | Mapping[str, Any],
        *,
        idempotency_key: str,
        queue: str | None = None,
        options: SubmitOptions | Mapping[str, Any] | None = None,
    ) -> SubmitResult:
        """Submit one task of this type through ``client`` (:meth:`OrbitClient.submit_task`).

        Raises:
            OrbitUsageError: the params do not match the model; nothing was sent.
            OrbitError: as :meth:`OrbitClient.submit_task`.
        """
        return client.submit_task(
            namespace, queue or self.queue, self.handler, self.dump(params),
            idempotency_key=idempotency_key, options=self.merged_options(options),
        )  # fmt: skip

    def handle(
        self, fn: Callable[[TaskContext, ParamsT], Any]
    ) -> Callable[[TaskContext], Any] | Callable[[TaskContext], Awaitable[Any]]:
        """The worker handler running ``fn(ctx, params)`` with the task's params as the model (a
        coroutine function gives a coroutine handler, for :class:`AsyncWorker`).

        A task whose params do not match the model fails at once, not retryable (error type
        ``OrbitUsageError``, the message naming each field), without calling ``fn``.
        """
        if inspect.iscoroutinefunction(fn):

            async def run_async(ctx: TaskContext) -> Any:
                return await fn(ctx, self.parse(ctx.params))

            return run_async

        def run(ctx: TaskContext) -> Any:
            return fn(ctx, self.parse(ctx.params))

        return run
