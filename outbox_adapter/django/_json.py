"""``normalize_json`` as ``django.tasks`` defines it (mappings → dicts, sequences → lists, bytes →
UTF-8 text), for a Django that does not export it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["normalize_json"]


def normalize_json(obj: Any) -> Any:
    """``obj`` as JSON-compatible types.

    Raises:
        TypeError: a value of another type (a ``datetime``, a model instance, ...).
        ValueError: bytes that are not UTF-8.
    """
    if isinstance(obj, Mapping):
        return {normalize_json(k): normalize_json(v) for k, v in obj.items()}
    if isinstance(obj, bytes):
        try:
            return obj.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"Unsupported value: {type(obj)}") from exc
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, Sequence):
        return [normalize_json(v) for v in obj]
    raise TypeError(f"Unsupported type: {type(obj)}")
