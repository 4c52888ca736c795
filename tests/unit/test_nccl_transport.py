"""NCCL's chosen transport, read from real NCCL INFO logs (tests/data/nccl, from public issues),
and the warnings when a slower path was taken though a faster one exists."""

from __future__ import annotations

import shutil
from pathlib import Path

from ddpkit.common.nccl_transport import parse, read, warnings

DATA = Path(__file__).parents[1] / "data" / "nccl"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def test_p2p_between_the_gpus_of_one_machine_is_read_per_pair():
    found = parse(lines("p2p_direct.log"))
    assert found.host == "hw14"
    assert found.local[(3, 4)] == {"P2P/direct"}
    assert found.local[(0, 7)] == {"P2P/direct"}
    assert not found.remote
    assert "GPU3<->GPU4" in found.line() or "pairs" in found.line()
    assert warnings(found, nvlinked=True, infiniband=[], interfaces={}) == []


def test_shm_between_nvlinked_gpus_is_a_warning_naming_nccl_p2p_disable():
    found = parse(lines("shm_8gpu.log"))
    assert found.local[(0, 4)] == {"SHM"}
    said = warnings(found, True, [], {}, environ={"NCCL_P2P_DISABLE": "1"})
    assert len(said) == 1
    assert "SHM" in said[0].what
    assert "NCCL_P2P_DISABLE=1 is set" in said[0].what
    assert said[0].fix.startswith("unset NCCL_P2P_DISABLE")
    assert warnings(found, nvlinked=False, infiniband=[], interfaces={}) == [], "PCIe only"


def test_sockets_between_nodes_that_have_infiniband_is_a_warning():
    found = parse(lines("socket_two_nodes.log"))
    assert found.remote == {"NET/Socket"}
    assert found.local[(3, 4)] == {"SHM"}
    said = warnings(found, False, ["mlx5_0"], {}, environ={"NCCL_IB_DISABLE": "1"})
    assert any(
        "TCP sockets between nodes" in s.what and "NCCL_IB_DISABLE=1" in s.what for s in said
    )
    assert warnings(found, False, [], {}, environ={}) == []


def test_infiniband_with_gpudirect_is_read_as_net_ib_and_no_warning():
    found = parse(lines("ib_gdrdma.log"))
    assert found.remote == {"NET/IB"}
    assert found.network == "IB"
    assert "to other nodes NET/IB (IB)" in found.line()
    assert warnings(found, True, ["mlx5_0"], {"eth0": 100000}) == []


def test_a_socket_on_a_slow_interface_while_a_faster_one_is_up_is_a_warning():
    log = [
        "node0:1:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>",
        "node0:1:2 [0] NCCL INFO Using network Socket",
        "node0:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0",
    ]
    found = parse(log)
    assert found.socket_ifs == ["eth0"]
    said = warnings(found, False, [], {"eth0": 1000, "eth1": 100000}, environ={})
    assert [str(s) for s in said] == [
        "NCCL's sockets use eth0 (1000 Mb/s) though eth1 (100000 Mb/s) is up; fix: "
        "NCCL_SOCKET_IFNAME=eth1"
    ]
    assert said[0].fix == "NCCL_SOCKET_IFNAME=eth1"


def test_a_run_folder_without_nccl_logs_says_so_and_one_rank_moves_nothing(tmp_path):
    assert read(tmp_path).line() == "no NCCL log yet"
    shutil.copy(DATA / "ib_gdrdma.log", tmp_path / "nccl-nccl-test-179.log")
    assert read(tmp_path).files == 1
    (tmp_path / "nccl-h-1.log").write_text("h:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 1\n")
    alone = read(tmp_path, host="h")
    assert "NCCL moves no data" in alone.line()
