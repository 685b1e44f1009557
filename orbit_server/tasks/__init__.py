"""Tasks: acceptance (:mod:`.store`, :mod:`.acceptance_batch`), the state machine (:mod:`.transitions`), leases
(:mod:`.leases`; PostgreSQL's autocommitted lease, :mod:`.postgres_leases`; what both read, :mod:`.lease_rows`),
a worker's reports (:mod:`.attempts`, :mod:`.attempt_sets`; their locking reads and lease checks,
:mod:`.attempt_locks`), permits and gates (:mod:`.permits`), operator actions and history (:mod:`.operations`,
:mod:`.admin`), result events (:mod:`.result_events`), the API key cache (:mod:`.keys`).

May import ``db`` and the root leaf modules only; the other areas import ``tasks`` where a rule needs it.
"""
