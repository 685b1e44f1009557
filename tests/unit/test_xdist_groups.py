"""``make test``'s grouping of tests on xdist workers (tests/xdist_groups.py): a module runs whole on one worker,
the cluster tests and the heavy acceptance modules each on one, the long groups start first, and the group
comes from the node id's path, with or without the ``@group`` suffix older pytest releases carried."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.xdist_groups import LONG_FIRST, group_of, make_scheduler

pytest.importorskip("xdist")


class _Node:
    """The part of an xdist WorkerController the scheduler uses: it records the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _config(dist: str, workers: int) -> Any:
    values = {"dist": dist, "tx": [f"{workers}*popen"]}
    return SimpleNamespace(getvalue=values.__getitem__, option=SimpleNamespace(loadscopereorder=True))


def test_the_group_of_a_module() -> None:
    assert group_of("integration/test_priority.py") == "integration/test_priority.py"
    assert group_of("tests/integration/test_priority.py") == "integration/test_priority.py"
    assert group_of("cluster/test_multi_primary.py") == "galera"
    assert group_of("tests/cluster/test_chaos_on_galera.py") == "galera"
    assert group_of("integration/django/test_django_consumer.py") == "django"
    assert group_of("tests/integration/django/test_django_enqueue.py") == "django"
    assert group_of("integration/test_django_shop_example.py") == "integration/test_django_shop_example.py"
    assert group_of("acceptance/test_chaos.py") == group_of("acceptance/test_docs_walkthrough.py") == "heavy"
    assert group_of("acceptance/test_admin_cli.py") == "acceptance/test_admin_cli.py"


def test_only_loadgroup_gets_the_suites_scheduler() -> None:
    assert make_scheduler(_config("load", 2), None) is None


@pytest.mark.parametrize("suffix", ["", "@ignored"])
def test_a_group_runs_whole_on_one_worker_and_the_long_groups_start_first(suffix: str) -> None:
    short = [f"tests/unit/test_many.py::test_{i}[x]" for i in range(20)]  # the most tests: xdist's first pick
    other = [f"tests/integration/test_a.py::test_{i}" for i in range(5)]
    cluster = ["tests/cluster/test_one.py::test_a", "tests/cluster/test_two.py::test_b"]
    heavy = ["tests/acceptance/test_chaos.py::test_a[mariadb]", "tests/acceptance/test_flow_load.py::test_b"]
    collection = [f"{nodeid}{suffix}" for nodeid in short + other + cluster + heavy]
    scheduler = make_scheduler(_config("loadgroup", 3), None)
    nodes = [_Node(f"gw{i}") for i in range(3)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, collection)
    assert scheduler.collection_is_completed
    scheduler.schedule()
    while not all(node.shutting_down for node in nodes):  # every node finishes what it was sent
        for node in nodes:
            for index in list(node.sent):
                scheduler.mark_test_complete(node, index)
    got = [[collection[i].removesuffix(suffix) for i in node.sent] for node in nodes]
    assert sorted(nodeid for tests in got for nodeid in tests) == sorted(short + other + cluster + heavy)
    for group in (short, other, cluster, heavy):
        assert [sum(nodeid in group for nodeid in tests) for tests in got].count(len(group)) == 1, got
    assert LONG_FIRST[:2] == ("heavy", "galera")
    assert got[0][: len(heavy)] == heavy and got[1][: len(cluster)] == cluster, got
