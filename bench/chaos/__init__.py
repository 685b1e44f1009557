"""``python -m bench.chaos``: the order service at scale under faults, with real database crashes.

    python -m bench.chaos [--orders 10000] [--faults 500] [--seed 1] [--json] [--no-skip-locked]
        [--server-db {mariadb,postgres}]

Starts two private MariaDB servers (``mariadb-install-db`` into temporary datadirs, their own
ports, ``innodb_flush_log_at_trx_commit=1``, binary log with ``sync_binlog=1``; the shared
server is never touched): the business database and the Orbit database, each behind a TCP
proxy that can cut every connection. Then, as real processes: Orbit servers
(``orbit-server serve``), the order API, batch relays, workers (batched attempt calls) and a
result consumer that also enqueues a follow-up per completed order.

While the orders are placed (a few requests are meant to be refused), a seeded schedule
injects the faults, spread over the run:

- SIGKILL at a precise point, through the test-only fault hooks: a relay between a batch send
  and its record, a worker between the payment provider's charge and its journal entry, the
  consumer between its commit and the ack, a server in the middle of a write transaction
  (before its commit);
- SIGKILL at a random moment of the API, a relay, a server, a worker, the consumer;
- every open connection of a database cut at once (the proxy);
- SIGKILL of ``mariadbd`` of either database (each several times), restarted on the same datadir.

With ``--server-db postgres`` the Orbit database is a private PostgreSQL instead (``initdb`` into a
temporary directory, run as the ``postgres`` OS user when started by root, its own port, behind the
same proxy; :mod:`bench.chaos.postgres`): its crashes SIGKILL the postmaster and its backends at once,
and it is restarted on the same data directory (WAL recovery).

After the last fault it waits for the system to drain, restarts both databases from disk, and
checks every invariant from the databases themselves (:mod:`bench.chaos.checks`). It prints a
table (``--json``: one object) and exits 1 on any violation (the run directory is then kept).
"""
