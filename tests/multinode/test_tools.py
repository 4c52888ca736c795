"""`ddpkit doctor` and `ddpkit bench` across two nodes (network namespaces): every node's
versions and route compared, one all_reduce over every rank of every node."""

from __future__ import annotations

import sys

import pytest

from tests.multinode.cluster import Cluster, available

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(available() is not None, reason=f"no namespaces: {available()}"),
]


@pytest.fixture
def two():
    cluster = Cluster(2)
    yield cluster
    cluster.close()


def on_both(cluster: Cluster, tmp, *argv: str):
    procs = [cluster.start(k, [sys.executable, "-m", "ddpkit", *argv], cwd=tmp) for k in (0, 1)]
    return [p.finish(150) for p in procs], procs


def test_doctor_on_every_node_compares_them_and_runs_one_all_reduce_across(two, tmp_path):
    codes, procs = on_both(two, tmp_path, "doctor", "--nnodes", "2", "--rdzv", "node0:29400")
    assert codes == [0, 0], procs[0].stdout + procs[0].stderr
    for p in procs:
        assert "smoke test   all_reduce on 4 rank(s) (gloo): correct" in p.stdout  # -n cpu: 2
        for n in two.nodes:
            assert f"node {n.host}: torch " in p.stdout
            assert f"reaches node 0 from {n.addr} (eth0)" in p.stdout


def test_bench_runs_across_nodes_with_nccl_tests_flags(two, tmp_path):
    codes, procs = on_both(
        two, tmp_path, "bench", "all_reduce", "-b", "8", "-e", "1K", "-f", "4",
        "-g", "2", "--nnodes", "2", "--rdzv", "node0:29400",
    )  # fmt: skip
    assert codes == [0, 0], procs[0].stdout + procs[0].stderr
    table = procs[0].stdout
    assert "#  Rank  3 Group  0" in table
    assert "node1" in table
    assert "# Out of bounds values : 0 OK" in table
