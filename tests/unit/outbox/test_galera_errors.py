"""The errors a Galera node gives when it leaves the primary component are transient for the relay and
the consumer: they wait and try again, as after any outage, instead of exiting (issue 22; README
"Scaling out"). Found by ``bench.chaos --cluster galera``: a relay and the consumer exited with
``error: cannot claim a batch of outbox rows: ... (1047, 'WSREP has not yet prepared node for
application use'); check the database``."""

from __future__ import annotations

import pymysql
import pytest
import sqlalchemy as sa

from outbox_adapter._db import translate_db_error


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (1047, "WSREP has not yet prepared node for application use"),
        (
            1180,
            "Error while appending streaming replication fragment(provider status: Not connected to Primary Component)",
        ),
        (1213, "Deadlock found when trying to get lock; try restarting transaction"),
    ],
)
def test_a_node_outside_the_primary_component_is_a_transient_failure(code: int, message: str) -> None:
    error = sa.exc.OperationalError("COMMIT", {}, pymysql.err.OperationalError(code, message))
    translated = translate_db_error(error, "claim a batch of outbox rows")
    assert translated.retryable
    assert "try again" in str(translated)


def test_a_missing_column_is_still_not_transient() -> None:
    error = sa.exc.OperationalError("SELECT", {}, pymysql.err.OperationalError(1054, "Unknown column 'x'"))
    assert not translate_db_error(error, "claim a batch of outbox rows").retryable
