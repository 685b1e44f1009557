"""The database layer: the schema (:mod:`.schema`), the engine and dialect differences (:mod:`.engine`),
:func:`.transact.transact` (one short transaction, retried on lock conflicts), the migrations runner
(:mod:`.migrate`), the sampled gauges (:mod:`.sampling`), fault points (:mod:`.faults`) and the flow hook a
commit runs (:mod:`.flow_hooks`).

May import sqlalchemy and the root leaf modules; nothing of the areas, ``api``, ``cli`` or ``console``.
"""
