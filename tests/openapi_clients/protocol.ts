// The worker protocol through a client generated from Orbit's served OpenAPI document (openapi-typescript
// + openapi-fetch): submit, replay, lease, start, complete, and read an error body's `code`. Type-checked by
// tests/integration/test_openapi_clients.py with `tsc --strict`; `./orbit` is the generated file.
import createClient from "openapi-fetch";
import type { components, paths } from "./orbit";

type Problem = components["schemas"]["Problem"];

export async function protocol(baseUrl: string, apiKey: string): Promise<string[]> {
  const client = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${apiKey}` } });
  const seen: string[] = [];
  const submission = {
    params: { path: { namespace: "shop" }, header: { "Idempotency-Key": "order-42" } },
    body: { queue: "fulfilment", handler: "orders.fulfil", params: { order_id: 42 } },
  };
  const first = await client.POST("/v1/namespaces/{namespace}/tasks", submission);
  if (first.error) {
    const problem: Problem = first.error;
    return [problem.code];
  }
  const taskId: string = first.data.id;
  seen.push(`${first.response.status} ${taskId} ${first.data.status}`);
  const again = await client.POST("/v1/namespaces/{namespace}/tasks", submission);
  seen.push(`replayed: ${again.response.headers.get("Idempotent-Replayed") ?? "no"}`);

  const leased = await client.POST("/v1/namespaces/{namespace}/queues/{queue}/leases", {
    params: { path: { namespace: "shop", queue: "fulfilment" } },
    body: { worker_id: "ts-worker", max_tasks: 1 },
  });
  for (const grant of leased.data ?? []) {
    const path = { namespace: "shop", attempt_id: grant.attempt.id };
    const token = grant.attempt.lease_token;
    const started = await client.POST("/v1/namespaces/{namespace}/attempts/{attempt_id}/start", {
      params: { path },
      body: { lease_token: token },
    });
    if (started.error) {
      return [...seen, started.error.code];
    }
    const generation: number = started.data.generation;
    const done = await client.POST("/v1/namespaces/{namespace}/attempts/{attempt_id}/complete", {
      params: { path },
      body: { lease_token: token, result: { generation } },
    });
    seen.push(`completed: ${done.data?.task_status ?? done.error?.code ?? "?"}`);
  }
  const reused = await client.POST("/v1/namespaces/{namespace}/tasks", {
    ...submission,
    body: { ...submission.body, handler: "orders.other" },
  });
  seen.push(reused.error?.code ?? "accepted");
  return seen;
}
