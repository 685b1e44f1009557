"""A private MariaDB Galera cluster for tests, fault runs and benchmarks (issue 22; README "Scaling out").

:mod:`bench.cluster.galera` starts, breaks and mends it; ``python -m bench.cluster`` keeps one up
for hand probing.
"""
