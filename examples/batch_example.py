# examples/batch_example.py
"""Submit many tasks in one request; each item keeps its own idempotency key and gets its own result."""

import os
import uuid

from orbit_client import OrbitClient

with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"], timeout=10.0) as client:
    run = uuid.uuid4()  # in real code each key is made once per intended task and stored beside it
    items = [
        {"idempotency_key": f"order-{run}-{n}-fulfil", "queue": queue, "handler": "orders.fulfil",
         "params": {"order_id": n}}
        for n, queue in ((1001, "fulfilment"), (1002, "fulfilment"), (1003, "no-such-queue"))
    ]  # fmt: skip
    # A failure of the request as a whole raises as submit_task does (sending the same batch again is safe);
    # a refused item is a result with its problem body, and the other items are accepted all the same.
    for item, result in zip(items, client.submit_tasks("shop", items), strict=True):
        if result.task is not None:
            print(
                item["idempotency_key"],
                result.status,
                "replayed" if result.replayed else "new",
                result.task.id,
            )
        elif result.error is not None:
            print(item["idempotency_key"], result.status, result.error.code)
