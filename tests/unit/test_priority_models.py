"""``priority`` on the wire models (README "Task priority"): -100..100, a whole number, and left out of the JSON
when unset, so that answers carrying options or a flow graph still parse in clients that predate it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from orbit_client import SubmitOptions, TaskNode, TaskSubmission


def test_unset_priority_is_left_out_of_the_json_and_set_priority_is_written() -> None:
    assert "priority" not in SubmitOptions().model_dump(mode="json")
    assert SubmitOptions(priority=-3).model_dump(mode="json")["priority"] == -3
    node = {"queue": "q", "handler": "h", "next": "end"}
    assert "priority" not in TaskNode.model_validate(node).model_dump(mode="json")
    assert TaskNode.model_validate({**node, "priority": 100}).model_dump(mode="json")["priority"] == 100


@pytest.mark.parametrize("value", [101, -101, 1.0, "1", True])
def test_a_priority_is_a_whole_number_from_minus_100_to_100(value: Any) -> None:
    with pytest.raises(ValidationError):
        SubmitOptions.model_validate({"priority": value})
    with pytest.raises(ValidationError):
        TaskNode.model_validate({"queue": "q", "handler": "h", "next": "end", "priority": value})


def test_priority_0_digests_as_no_priority_and_any_other_does_not() -> None:
    def meaning(options: Any) -> dict[str, Any]:
        return TaskSubmission(queue="q", handler="h", options=options).canonical_meaning()

    assert meaning({"priority": 0}) == meaning(None) == meaning({})
    assert meaning({"priority": 1}) != meaning(None)
