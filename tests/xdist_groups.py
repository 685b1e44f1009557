"""Which tests share an xdist worker under ``make test`` (``pytest -n N --dist loadgroup``), and in what order
the groups start.

A group runs whole on one worker, one test after another: a test module (its module-scoped servers and
databases are made once), every cluster test (``galera``: they share the session's Galera cluster), every
Django test (``django``: they share the process's Django project, its Orbit server and namespace, and pass in
the order they are collected in; ``test_django_consumer`` leased the tasks ``test_django_enqueue`` left behind
when it ran after it on one worker), and the heavy acceptance modules (``heavy``: :data:`HEAVY`, so that two of them never share the cores; each was seen to
miss its deadline beside another at load 7).

xdist's own ``loadgroup`` reads the ``xdist_group`` mark on the workers and passes it to the scheduler by
appending ``@group`` to each test's node id. From pytest 9.2 on a node id is built from the node's structured
id and that append has no effect (pytest-xdist issue 1386): every test became a group of its own, so a module's
tests ran on all workers (each setting up the module's servers, databases, browser and docs site again), the
heavy modules ran beside each other, and each worker that met a cluster test started a Galera cluster of its
own. :class:`GroupScheduling` therefore takes the group from the node id's file path (:func:`group_of`), which
both pytest 8 and 9 report, and never from the suffix.

xdist starts groups in decreasing number of tests, so ``heavy`` (36 tests, ~7 min alone on a 2-core machine at
load 3) started after ~20 modules and ``galera`` (13 tests, ~2 min) after ~60: a late long group is what the run
waits for at its end. The groups of :data:`LONG_FIRST` start first; the others follow in xdist's order.
"""

from __future__ import annotations

from typing import Any

#: Acceptance modules that run many processes against deadlines (chaos, demos, crash loops, load): one group.
HEAVY = frozenset(
    f"acceptance/{name}.py"
    for name in (
        "test_chaos", "test_claims_without_locks", "test_flow_cli", "test_flow_crashes", "test_flow_load",
        "test_order_service_demo", "test_docs_walkthrough", "test_worker_processes",
    )
)  # fmt: skip

#: The groups that take several minutes, longest first: they start before every other group. (The next
#: longest, the OpenAPI fuzz and the worker pipeline, take 1-2 min; the order of those barely matters.)
LONG_FIRST = ("heavy", "galera")


def group_of(module: str) -> str:
    """The xdist group of a test module.

    Args:
        module: the module's path relative to ``tests/`` (``"acceptance/test_chaos.py"``); a path relative to
            the repository (``"tests/acceptance/test_chaos.py"``) gives the same group.

    Returns:
        ``"galera"`` for the cluster tests, ``"django"`` for those of ``integration/django/``, ``"heavy"`` for
        :data:`HEAVY`, else ``module`` (relative to ``tests/``).
    """
    module = module.removeprefix("tests/")
    if module.startswith("cluster/"):
        return "galera"
    if module.startswith("integration/django/"):
        return "django"
    if module in HEAVY:
        return "heavy"
    return module


def make_scheduler(config: Any, log: Any) -> Any:
    """A :class:`GroupScheduling` for ``--dist loadgroup``, else ``None`` (xdist picks its own)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        """xdist's ``loadgroup`` with the groups of :func:`group_of`, :data:`LONG_FIRST` started first."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node: Any) -> None:
            for group in reversed(LONG_FIRST):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)
