"""Problem details (RFC 9457): the body of every error answer, and the exception handlers that turn the
domain errors of :mod:`orbit_server.errors`, validation errors and HTTP errors into one, with a stable ``code``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orbit_client import (
    JSON_MAX_DEPTH,
    JSON_MAX_INTEGER_DIGITS,
    Problem,
)
from orbit_client._problems import readable_errors
from orbit_server import errors
from orbit_server.api.json_bodies import invalid_json

__all__ = ["install_problem_handlers", "problem_response"]

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def problem_response(
    status: int, code: str, title: str, detail: str | None, request_id: str | None, **extra: Any
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, code=code, request_id=request_id, **extra)
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=status,
        media_type="application/problem+json",
    )


#: Why FastAPI could not parse a JSON body (its 400 carries the parser's exception as ``__cause__``).
def _unreadable_body(cause: BaseException | None) -> tuple[str, str] | None:
    if isinstance(cause, UnicodeDecodeError):
        return "invalid_utf8", "the body is not valid UTF-8 (RFC 8259 §8.1)"
    if isinstance(cause, RecursionError):
        return "nesting_too_deep", (
            f"the body nests arrays and objects too deeply to parse; JSON data may nest at most "
            f"{JSON_MAX_DEPTH} levels"
        )
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "integer_too_long", (
            f"an integer in the body has more than {JSON_MAX_INTEGER_DIGITS} digits, the most JSON data may have"
        )
    return None


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _domain_error(request: Request, exc: errors.OrbitServerError) -> JSONResponse:
    response = problem_response(
        exc.status, exc.code, exc.title, exc.detail, _request_id(request), **exc.extra
    )
    response.headers.update(exc.headers)
    return response


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    not_json = invalid_json(list(exc.errors()), exc.body)
    if not_json is not None:  # not a field's problem: the body is no JSON at all (README "HTTP API")
        return problem_response(400, "invalid_json", "The body is not JSON", not_json, _request_id(request))
    # Report where and why, never the offending input (it may hold params). A validator's own
    # message (e.g. "node 'a': next 'b' is not a node of the graph") loses pydantic's prefix.
    problems = readable_errors(exc.errors())
    detail = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
    return problem_response(
        422, "validation_error", "The request is not valid", detail, _request_id(request), errors=problems
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = getattr(exc, "code", None) or _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    detail = str(exc.detail)
    if exc.status_code == 400 and (unreadable := _unreadable_body(exc.__cause__)) is not None:
        code, detail = unreadable
    response = problem_response(exc.status_code, code, code.replace("_", " ").capitalize(), detail,
                                _request_id(request))  # fmt: skip
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def install_problem_handlers(app: FastAPI) -> None:
    """Answer every domain error, validation error and HTTP error of ``app`` with a problem body."""
    app.add_exception_handler(errors.OrbitServerError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
