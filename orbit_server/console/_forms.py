"""What the console's forms send, checked by the API's own request models (one validation path).

A console action builds the same request body the API's endpoint takes (``CancelRequest``,
``ReviewRequest``, ``RetryRequest``) and validates it with the same pydantic model, so the
lengths (reason 2,000, evidence 1,000, on behalf of 255 characters) and the JSON data rules
(:func:`orbit_client.check_json_data`: finite numbers, valid Unicode, at most 30 levels, at
most 4,300 digits) are the API's, and a value the database could not give back is never
stored. A form that breaks a rule is answered ``422`` with the rule, as the API answers
``422 validation_error``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from typing import Any, TypeVar
from urllib.parse import parse_qs

from pydantic import BaseModel, ValidationError

from orbit_client import JSON_MAX_DEPTH, JSON_MAX_INTEGER_DIGITS

__all__ = ["FormError", "LoginThrottle", "form_fields", "json_field", "validated"]

M = TypeVar("M", bound=BaseModel)

#: A form field's name as the operator reads it on the page, by the API body field it fills.
_LABELS = {
    "reason": "The reason",
    "evidence_ref": "The evidence reference",
    "actor": "'On behalf of'",
    "result": "The result",
    "outcome": "The outcome",
    "deadline": "The deadline",
}


class FormError(ValueError):
    """A form field breaks one of the API's rules; the message names the field and the rule."""


def form_fields(body: bytes) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body as ``{name: first value}``.

    Bytes that are not UTF-8 become U+FFFD (as a browser never sends them), so every value is
    a valid Unicode string.
    """
    text = body.decode("utf-8", errors="replace")
    return {name: values[0] for name, values in parse_qs(text, keep_blank_values=True).items()}


def json_field(raw: str) -> Any:
    """Parse the JSON text of a form field as the API parses a JSON body.

    Raises:
        FormError: not JSON, nested too deeply to parse, or an integer too long to read; the
            API answers these ``400`` (``invalid_json``, ``nesting_too_deep``,
            ``integer_too_long``). What parses is checked by the request model afterwards.
    """
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise FormError(f"The result is not JSON: {exc}") from None
    except RecursionError:
        raise FormError(
            f"The result nests arrays and objects deeper than {JSON_MAX_DEPTH} levels (the limit)."
        ) from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion"
        if "integer string conversion" in str(exc):
            raise FormError(
                f"The result has an integer of more than {JSON_MAX_INTEGER_DIGITS} digits (the limit)."
            ) from None
        raise FormError(f"The result is not JSON: {exc}") from None


def validated(model: type[M], fields: dict[str, Any]) -> M:
    """``fields`` validated by ``model``, the API endpoint's own request body model.

    Raises:
        FormError: the first rule a field breaks, e.g. "The reason: String should have at most
            2000 characters".
    """
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False, include_input=False):
            loc = error.get("loc", ())
            label = _LABELS.get(str(loc[0]), str(loc[0])) if loc else "The form"
            message = str(error.get("msg", "")).removeprefix("Value error, ")
            problems.append(f"{label}: {message}.")
        raise FormError(" ".join(problems) or "The form is not valid.") from None


class LoginThrottle:
    """Failed console sign-ins per client address: at most ``limit`` in any ``window`` seconds.

    In memory, per server process (each process of ``serve --workers N`` counts its own); at
    most ``max_addresses`` addresses are remembered, the least recently failing forgotten first.
    ``limit`` 0 turns the limit off.
    """

    def __init__(self, limit: int, window: float = 60.0, *, max_addresses: int = 10_000) -> None:
        self.limit = limit
        self.window = window
        self._max = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        if self.limit <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get(address)
            if failures is None:
                return 0.0
            while failures and failures[0] <= now - self.window:
                failures.popleft()
            if len(failures) < self.limit:
                return 0.0
            return max(failures[0] + self.window - now, 0.0)

    def failed(self, address: str) -> None:
        """Count a failed sign-in of ``address``."""
        if self.limit <= 0:
            return
        with self._lock:
            failures = self._failures.pop(address, None) or deque(maxlen=self.limit)
            failures.append(time.monotonic())
            self._failures[address] = failures
            while len(self._failures) > self._max:
                self._failures.popitem(last=False)
