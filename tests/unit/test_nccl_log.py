"""NCCL's transport choices read from its INIT log (raybench/runtime/nccl_log.py), and the fallbacks named. The
lines are written here in the form NCCL 2.18-2.27 logs them (`transport.cc`'s Channel line, `init.cc`'s comm
line, `net.cc`'s "Using network"); the same parsing on a real GPU's log is GPU round 11's."""

from __future__ import annotations

import os

import pytest

from raybench.runtime import nccl_log

ONE_NODE_NVLINK = """\
gpu-a:4001:4050 [0] NCCL INFO comm 0x5581c0a0b0c0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0
gpu-a:4001:4050 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:4001:4050 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:4001:4050 [0] NCCL INFO Connected all rings
"""
TWO_NODES_SOCKETS = """\
gpu-a:4001:4001 [0] NCCL INFO NET/IB : No device found.
gpu-a:4001:4001 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
gpu-a:4001:4001 [0] NCCL INFO Using network Socket
gpu-a:4001:4050 [0] NCCL INFO comm 0x5581c0a0b0c0 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
gpu-a:4001:4050 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
gpu-a:4001:4052 [7] NCCL INFO Channel 01/0 : 7[7] -> 8[0] [send] via NET/Socket/0
"""
ONE_NODE_SHM = """\
gpu-a:4001:4050 [0] NCCL INFO comm 0x5581c0a0b0c0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0
gpu-a:4001:4050 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
"""
TWO_NODES_IB = """\
gpu-a:4001:4001 [0] NCCL INFO Using network IB
gpu-a:4001:4050 [0] NCCL INFO comm 0x5581c0a0b0c0 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
gpu-a:4001:4050 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer
gpu-a:4001:4052 [7] NCCL INFO Channel 01/0 : 7[7] -> 8[0] [send] via NET/IB/0/GDRDMA
"""


def test_nvlink_inside_a_node_and_ib_between_nodes_are_ok():
    one = nccl_log.transports(ONE_NODE_NVLINK)
    assert one == {"transports": ["P2P/CUMEM"], "max_nodes": 1, "network": None}
    assert nccl_log.check_text(one, hosts=1, environ={}) == "ok"
    two = nccl_log.transports(TWO_NODES_IB)
    assert two["transports"] == ["NET/IB", "P2P/direct pointer"] and two["network"] == "IB"
    assert nccl_log.check_text(two, hosts=2, environ={}) == "ok"


def test_sockets_between_nodes_are_a_fallback_naming_what_usually_causes_it():
    found = nccl_log.merged([nccl_log.transports(TWO_NODES_SOCKETS), nccl_log.transports(ONE_NODE_NVLINK)])
    assert found["transports"] == ["NET/Socket", "P2P/CUMEM", "P2P/IPC"] and found["max_nodes"] == 2
    said = nccl_log.check_text(found, hosts=2, environ={"NCCL_IB_DISABLE": "1", "HOME": "/root"})
    assert said == ("fallback: sockets between nodes (usual causes: NCCL_IB_DISABLE, NCCL_NET, NCCL_IB_HCA, "
                    "NCCL_SOCKET_IFNAME; set here: NCCL_IB_DISABLE=1)")


def test_shared_memory_or_the_network_inside_one_node_is_a_fallback():
    assert nccl_log.check_text(nccl_log.transports(ONE_NODE_SHM), 1, {}).startswith(
        "fallback: shared memory inside one node (usual causes: NCCL_P2P_DISABLE")
    inside = nccl_log.transports(TWO_NODES_SOCKETS.replace("nNodes 2", "nNodes 1"))
    assert "the network inside one node" in nccl_log.check_text(inside, 1, {})
    # Without NCCL's comm line (older NCCL), the hosts the ranks ran on decide.
    no_comm = nccl_log.transports(TWO_NODES_SOCKETS.replace("nNodes 2", "nNodes").replace(" comm ", " "))
    assert no_comm["max_nodes"] is None
    assert "sockets between nodes" in nccl_log.check_text(no_comm, 2, {})
    assert "the network inside one node" in nccl_log.check_text(no_comm, 1, {})


def test_not_checked_says_why():
    assert nccl_log.check_text(None, 1) == "not checked (NCCL_DEBUG_FILE set by the user)"
    assert nccl_log.check_text(nccl_log.transports(""), 1) == "not checked (no NCCL channel was set up)"


def test_capture_logs_to_a_file_of_the_process_and_reads_only_what_came_after(monkeypatch, tmp_path):
    monkeypatch.setattr(nccl_log.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(nccl_log, "_FILE", {})
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    nccl_log.capture()
    path = tmp_path / "raybench-nccl" / f"nccl-{os.getpid()}.log"
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert os.environ["NCCL_DEBUG_FILE"] == str(path)
    path.write_text(ONE_NODE_SHM)  # as NCCL writes it: an earlier trial of a warm process
    nccl_log.capture()  # the next trial
    with open(path, "a") as f:
        f.write(ONE_NODE_NVLINK)
    assert nccl_log.transports(nccl_log.logged())["transports"] == ["P2P/CUMEM"]


def test_a_users_own_nccl_log_is_left_alone(monkeypatch):
    monkeypatch.setattr(nccl_log, "_FILE", {})
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/somewhere/nccl.%h.%p")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    nccl_log.capture()
    assert os.environ["NCCL_DEBUG"] == "WARN" and nccl_log.logged() is None


@pytest.mark.parametrize("line, transport", [
    ("h:1:2 [0] NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3", "NET/Socket"),
    ("h:1:2 [0] NCCL INFO Channel 02/0 : 8[0] -> 15[7] via P2P/IPC/read", "P2P/IPC"),
    ("h:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/direct pointer", "P2P/direct pointer"),
    ("h:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/1/GDRDMA", "NET/IB"),
])
def test_each_form_of_the_channel_line(line, transport):
    assert nccl_log.transports(line + "\n")["transports"] == [transport]
