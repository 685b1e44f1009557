"""Orbit on one Galera node vs spread over three, on one private 3-node cluster (README "Scaling out").

    python -m bench.cluster.bench [--tasks 600] [--clients 12] [--rounds 3] [--json]

Two topologies on the same cluster, so that replication costs the same in both and only where the
writes land differs: **one node** (three ``orbit-server serve`` processes, all on node 0, the
single-primary way) and **three nodes** (one server per node, multi-primary). For each:

- acceptance: ``--tasks`` single submissions from ``--clients`` threads, round robin over the
  servers (requests/s, p50 and p99 latency);
- batch acceptance: the same number of tasks in batches of 50;
- relay: ``--tasks`` outbox rows (business database on the cluster too) delivered by one relay
  through one server (node 0, or node 1 for three nodes);
- workers: ``--tasks`` tasks run by three worker processes, one per server;
- the cluster's ``wsrep_local_cert_failures`` and ``wsrep_local_bf_aborts`` over the whole round,
  per 1,000 tasks.

The two topologies alternate for ``--rounds`` pairs (one node, then three nodes, then again), and
every figure is printed as each topology's median and the median of the pairs' ratios (three nodes
/ one node), with each pair's ratio and the load average: on a shared machine a pair run minutes
apart meets the same load, a single pair does not (two single pairs once gave 0.44 and 2.19 for the
same figure). This machine has two cores shared by the three nodes, the servers, the clients and
the workers: the ratio says what multi-primary costs or saves here, never what more machines would
give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench._support import cli, orbit_server_processes
from bench.cluster.galera import GaleraCluster
from bench.relay import relay_round
from bench.workers import run_round

__all__ = ["main"]


def _accept(bases: list[str], key: str, tasks: int, clients: int, size: int) -> tuple[float, list[float]]:
    """``tasks`` tasks accepted in requests of ``size`` items (1: the single endpoint) from ``clients``
    threads, round robin over ``bases``: (tasks/s, every request's latency in seconds)."""
    run = uuid.uuid4().hex[:8]
    per_client = max(1, tasks // clients // size)
    latencies: list[float] = []
    failures: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def work(index: int) -> None:
        with httpx.Client(base_url=bases[index % len(bases)], headers={"Authorization": f"Bearer {key}"},
                          timeout=120) as http:  # fmt: skip
            barrier.wait()
            for r in range(per_client):
                first = (index * per_client + r) * size
                began = time.perf_counter()
                if size == 1:
                    response = http.post("/v1/namespaces/bench/tasks", headers={"Idempotency-Key": f"{run}-{first}"},
                                         json={"queue": "q", "handler": "bench.noop", "params": {"n": first}})  # fmt: skip
                else:
                    items = [{"idempotency_key": f"{run}-{first + n}", "queue": "q", "handler": "bench.noop",
                              "params": {"n": first + n}} for n in range(size)]  # fmt: skip
                    response = http.post("/v1/namespaces/bench/tasks/batch", json={"items": items})
                latencies.append(time.perf_counter() - began)
                if response.status_code not in (200, 201):
                    failures.append(f"{response.status_code} {response.text[:200]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return per_client * clients * size / elapsed, latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


@contextmanager
def _servers(urls: list[str]) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(orbit_server_processes(url, 1))[0].base for url in urls]


def topology(
    cluster: GaleraCluster, label: str, nodes: list[int], tasks: int, clients: int
) -> dict[str, Any]:
    """One round: a fresh Orbit database and business database, servers on ``nodes``."""
    name = f"orbit_bench_{uuid.uuid4().hex[:8]}"
    cluster.create_database(name)
    cluster.create_database(f"{name}_shop")
    url = cluster.nodes[0].url(name)
    cli("migrate", url=url)
    cli("namespace", "create", "bench", url=url)
    for queue in ("q", "work"):
        cli("queue", "create", "bench", queue, url=url)
    keys = {role: cli("api-key", "create", "bench", "--role", role, url=url) for role in ("submit", "work")}
    cluster.wait_size(cluster.size)
    before = cluster.counters()
    out: dict[str, Any] = {"topology": label, "server_nodes": nodes}
    with _servers([cluster.nodes[n].url(name) for n in nodes]) as bases:
        rate, latencies = _accept(bases, keys["submit"], tasks, clients, 1)
        out["acceptance_per_s"] = round(rate, 1)
        out["acceptance_p50_ms"] = round(1000 * _percentile(latencies, 0.5), 1)
        out["acceptance_p99_ms"] = round(1000 * _percentile(latencies, 0.99), 1)
        rate, _ = _accept(bases, keys["submit"], tasks, max(1, clients // 4), 50)
        out["batch_acceptance_per_s"] = round(rate, 1)
        business = sa.create_engine(
            cluster.nodes[nodes[-1] if len(set(nodes)) > 1 else 0].url(f"{name}_shop")
        )
        relay_base = bases[1] if len(set(nodes)) > 1 else bases[0]
        try:
            rows_per_s, _, _ = relay_round(business, business.url.render_as_string(False), relay_base,
                                           keys["submit"], tasks, 4, 50, own=False)  # fmt: skip
        finally:
            business.dispose()
        out["relay_rows_per_s"] = round(rows_per_s, 1)
        out["worker_tasks_per_s"] = round(run_round(bases, url, keys, "work", tasks, 3, 4), 1)
    after = cluster.counters()
    accepted = 4 * tasks  # single + batch + relay + workers' tasks
    for key in ("wsrep_local_cert_failures", "wsrep_local_bf_aborts"):
        out[f"{key.removeprefix('wsrep_local_')}_per_1000_tasks"] = round(
            1000 * (after[key] - before[key]) / accepted, 2
        )
    cluster.drop_database(name)
    cluster.drop_database(f"{name}_shop")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tasks", type=int, default=600, help="tasks per measurement (default 600)")
    parser.add_argument("--clients", type=int, default=12, help="client threads for acceptance (default 12)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="pairs of rounds, one node then three (default 3)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="orbit-galera-bench-"))
    cluster = GaleraCluster(root, 3)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        cluster.start()
        for _ in range(max(1, args.rounds)):
            one = topology(cluster, "1 node (3 servers on node 0)", [0, 0, 0], args.tasks, args.clients)
            one["loadavg_1m"] = round(os.getloadavg()[0], 2)
            three = topology(cluster, "3 nodes (1 server per node)", [0, 1, 2], args.tasks, args.clients)
            three["loadavg_1m"] = round(os.getloadavg()[0], 2)
            pairs.append((one, three))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    measures = [k for k, v in pairs[0][0].items() if isinstance(v, int | float) and k != "loadavg_1m"]
    summary: dict[str, Any] = {}
    for key in measures:
        ratios = [three[key] / one[key] if one[key] else None for one, three in pairs]
        known = [r for r in ratios if r is not None]
        summary[key] = {
            "one_node": statistics.median(one[key] for one, _ in pairs),
            "three_nodes": statistics.median(three[key] for _, three in pairs),
            "ratio_median": round(statistics.median(known), 2) if known else None,
            "ratios": [round(r, 2) if r is not None else None for r in ratios],
        }
    loads = [p[i]["loadavg_1m"] for p in pairs for i in (0, 1)]
    if args.json:
        print(json.dumps({"summary": summary, "rounds": pairs, "loadavg_1m": loads}, indent=2))
        return 0
    print(
        f"{args.rounds} pairs of rounds, {args.tasks} tasks per measurement; load average {min(loads)}-{max(loads)}"
    )
    print(f"{'measure':<34}{'1 node':>10}{'3 nodes':>10}{'ratio':>8}  pairs")
    for key, row in summary.items():
        ratio = "-" if row["ratio_median"] is None else f"{row['ratio_median']:.2f}"
        pairs_text = ", ".join("-" if r is None else f"{r:.2f}" for r in row["ratios"])
        print(f"{key:<34}{row['one_node']!s:>10}{row['three_nodes']!s:>10}{ratio:>8}  {pairs_text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
