# examples/schedule_example.py
"""Create schedules: a nightly cron in a time zone, and an every-second interval whose tasks we watch."""

import os
import time
import uuid

from orbit_client import OrbitClient

with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"], timeout=10.0) as client:
    suffix = uuid.uuid4().hex[:6]  # schedule names are unique per namespace
    nightly = client.create_schedule(
        "shop", f"nightly-report-{suffix}", queue="reports", handler="reports.nightly",
        params={"kind": "daily"}, cron="30 2 * * *", timezone="Europe/Berlin",
        misfire_policy="run_once",  # after an outage: one task for the latest missed night
        overlap_policy="skip_if_running",  # never two reports at once
    )  # fmt: skip
    print(nightly.name, "next fire (UTC):", nightly.next_fire_at)

    ticks = client.create_schedule("shop", f"tick-{suffix}", queue="reports", handler="reports.tick",
                                   interval_seconds=1)  # fmt: skip
    while not (occurrences := client.list_occurrences("shop", ticks.name)):
        time.sleep(0.2)  # the scheduler in the server fires it within a second
    first = occurrences[0]
    task = client.get_task("shop", first.task_id or "")
    print(ticks.name, "fired at", first.scheduled_at, "-> task", task.id, task.status)
    # The task is an ordinary submission: its idempotency key is the schedule id and the fire time.
    key = f"schedule:{ticks.id}:{first.scheduled_at:%Y-%m-%dT%H:%M:%SZ}"
    assert client.find_submission("shop", key) == task

    client.pause_schedule("shop", ticks.name)
    client.delete_schedule("shop", ticks.name)  # its tasks stay
