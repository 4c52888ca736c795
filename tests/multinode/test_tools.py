"""`ddpkit doctor`, `ddpkit bench` and `ddpkit profile` across two nodes (network namespaces):
every node's versions and route compared, one all_reduce over every rank of every node; one
command on node 0 records every node's ranks."""

from __future__ import annotations

import gzip
import json
import signal
import sys
from pathlib import Path

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


def test_profile_on_node_0_records_every_nodes_ranks_and_names_the_slow_one_on_node_1(
    two, tmp_path
):
    from tests.multinode.test_nodes import assert_nothing_left, rdzv, run_on

    # rank 1 (node 1) does extra matmuls from the second phase on: it holds rank 0 back
    uneven = str(Path(__file__).parents[1] / "e2e" / "scripts" / "uneven.py")
    phases = ["even", *["compute:3"] * 6]
    args = [*rdzv(two, 2), uneven, *phases, "--phase", "150", "--io", "0.01"]
    procs = run_on(two, tmp_path, args)
    procs[1].wait_for("extra", timeout=120)
    run_id = procs[0].run_id  # type: ignore[attr-defined]
    asked = two.start(0, [sys.executable, "-m", "ddpkit", "profile", run_id, "--steps", "5"])
    code = asked.finish(120)
    said = asked.stdout
    assert code == 0, said + asked.stderr
    assert "on 2 rank(s) of 2 nodes" in said, said
    assert "the others wait for rank 1: its compute time stands out" in said, said
    (folder,) = (tmp_path / "node0").glob(f"{run_id}*/profile-*")
    summaries = [json.loads((folder / f"rank{r}.summary.json").read_text()) for r in (0, 1)]
    assert [s["recorded"] for s in summaries] == [5, 5]
    assert summaries[0]["plan"]["first"] == summaries[1]["plan"]["first"], "the same steps"
    # node 1's trace stays on node 1, in its own run folder, and the breakdown says where
    (trace,) = (tmp_path / "node1").glob(f"{run_id}*/{folder.name}/rank1.trace.json.gz")
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "gloo:all_reduce" in names
    assert f"node 1 (node1) keeps its ranks' traces: {trace.parent}" in said, said
    assert "this node's ranks on one timeline" in said, "node 0's merged trace holds rank 0"
    for p in procs:  # the job went on: it ends on a stop signal, as a user's would
        assert p.popen.poll() is None, p.stderr
        p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        p.finish(60)
    assert_nothing_left(procs)
