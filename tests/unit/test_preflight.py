"""The pre-flight's judgement of planted device figures, its measurement on this host, and its rows in the store
read back by an independent reader. The same check on a 2-node SLURM with one node held back for real:
tests/integration/test_cluster_faults.py::test_the_preflight_names_a_throttled_node."""

from __future__ import annotations

import duckdb
import pytest
import torch

from raybench.drivers import preflight, preflight_links
from raybench.drivers.nodes import Node
from raybench.results import health
from raybench.runtime import preflight as measure
from tests.unit.planted_rows import plant_cpu_store


def _device(node: str, matmul: float, memory: float, h2d: float | None = 55.0, device: str = "NVIDIA H100 80GB HBM3",
            index: int | None = 0) -> dict:
    return {"node": node, "ray_node_id": f"id-{node}", "hostname": node, "device": device, "device_index": index,
            "torch_threads": 8, "matmul_tflops": matmul, "memory_gb_per_s": memory, "host_to_device_gb_per_s": h2d}


def test_a_device_below_the_tolerance_of_the_fastest_of_its_kind_is_named_with_what_is_slow():
    rows = preflight.verdicts([_device("n1", 700, 3000), _device("n2", 690, 2950), _device("n3", 520, 2990)])
    slow = {r["node"]: r["why"] for r in rows if r["slow"]}
    assert list(slow) == ["n3"]
    assert slow["n3"] == "matmul 520 is 74% of the fastest NVIDIA H100 80GB HBM3's 700"
    n3 = next(r for r in rows if r["node"] == "n3")
    assert n3["matmul_tflops_of_fastest"] == pytest.approx(520 / 700)
    # Against the table: the H100 SXM's 989 bf16 TFLOP/s and 3.35 TB/s.
    assert n3["matmul_tflops_of_table"] == pytest.approx(520 / 989, rel=0.01)
    assert n3["memory_gb_per_s_of_table"] == pytest.approx(2990 / 3350, rel=0.01)
    # A looser tolerance lets it pass; half the table's figure does not.
    assert not any(r["slow"] for r in preflight.verdicts([_device("n1", 700, 3000), _device("n3", 520, 2990)], 0.5))
    assert preflight.verdicts([_device("n1", 700, 3000), _device("n3", 480, 2990)], 0.5)[1]["slow"]


def test_every_gpu_of_a_capped_node_is_slow_against_the_table_even_with_no_faster_peer():
    rows = preflight.verdicts([_device("n1", 300, 3000, index=0), _device("n1", 310, 3000, index=1)])
    assert all(r["slow"] for r in rows)
    assert "of the table's 989" in rows[0]["why"] and "of the fastest" not in rows[0]["why"]


def test_cpu_nodes_are_compared_with_each_other_only():
    rows = preflight.verdicts([_device("a", 0.05, 10.0, None, "cpu", None), _device("b", 0.01, 9.0, None, "cpu", None)])
    assert [r["slow"] for r in rows] == [False, True]
    assert rows[1]["matmul_tflops_of_table"] is None and rows[1]["host_to_device_gb_per_s_of_fastest"] is None
    assert rows[1]["why"].startswith("matmul 0.01 is 20% of the fastest cpu's 0.05")
    lines = preflight.summary([{**r, "cluster": "c", "job_id": "1", "checked_at": "t"} for r in rows])
    assert lines[-1].startswith("slow node(s): b;") and "SLOW: matmul" in lines[1]


def test_this_hosts_figures_are_measured_and_stored_whole(tmp_path):
    figures = measure.measure(torch.device("cpu"))
    assert figures["device"] == "cpu" and figures["matmul_tflops"] > 0 and figures["memory_gb_per_s"] > 0
    assert figures["host_to_device_gb_per_s"] is None
    rows = [{"cluster": "c", "job_id": "7", "checked_at": "2026-12-07T18:00:00+00:00", **r}
            for r in preflight.verdicts([{"node": "n1", "ray_node_id": "x", **figures}])]
    health.save_check(tmp_path, rows)
    later = [{**rows[0], "checked_at": "2026-12-07T19:00:00+00:00", "slow": True, "why": "planted"}]
    health.save_check(tmp_path, later)
    assert health.read_checks(tmp_path).column("why").to_pylist() == ["planted"]  # each cluster's newest check
    assert health.read_checks(tmp_path, latest=False).num_rows == 2
    glob = str(tmp_path / health.HEALTH_DIR / "*.parquet")
    read = duckdb.sql(f"select node, slow, matmul_tflops from read_parquet('{glob}') order by checked_at").fetchall()
    assert read == [("n1", False, figures["matmul_tflops"]), ("n1", True, figures["matmul_tflops"])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_a_gpus_figures_sit_below_its_tables():
    figures = measure.measure(torch.device("cuda", 0))
    rows = preflight.verdicts([{"node": "n1", "ray_node_id": "x", **figures}])
    for figure in preflight.FIGURES:
        assert 0 < rows[0][f"{figure}_of_table"] < 1.05, (figure, figures)


def test_the_report_shows_each_clusters_latest_check(tmp_path, capsys):
    from raybench.cli.main import main

    planted = [_device("n1", 700, 3000), _device("n2", 520, 2990)]
    for stamp in ("2026-12-07T18:00:00+00:00", "2026-12-07T19:00:00+00:00"):
        health.save_check(tmp_path, [{"cluster": "c", "job_id": "7", "checked_at": stamp, **r}
                                     for r in preflight.verdicts(planted)])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    section = out[out.index("Cluster health"):]
    assert "2026-12-07T19:00:00+00:00" in section and "2026-12-07T18:00:00+00:00" not in section
    assert "matmul 520 is 74% of the fastest" in section and "74%" in section
    plant_cpu_store(tmp_path)  # the files' report needs trial rows beside the checks
    assert main(["report", str(tmp_path), "--format", "md", "--out", str(tmp_path / "r.md")]) == 0
    assert "## Cluster health" in (tmp_path / "r.md").read_text()


def _node(name: str, gpus: int = 0) -> Node:
    return Node(node_id=f"id-{name}", name=name, ip=f"10.0.0.{name[-1]}", alive=True, cpus=8, gpus=gpus)


def _link(node: str, peer: str | None, busbw: float | None, ranks: int = 2, error: str | None = None) -> dict:
    return {"node": node, "ray_node_id": f"id-{node}", "peer_node": peer,
            "link": preflight_links.PAIR if peer else preflight_links.INSIDE, "link_ranks": ranks,
            "busbw_gb_per_s": busbw, "link_error": error}


def test_links_are_planned_in_rounds_that_share_no_node():
    assert preflight_links.plan([_node("n1")]) == []  # one CPU node: no link to measure
    (only,) = preflight_links.plan([_node("n2"), _node("n1")])
    assert [tuple(n.name for n in link) for link in only] == [("n1", "n2")]  # two nodes: one pair, not two
    gpu_nodes = [_node(f"n{i}", gpus=8) for i in range(1, 6)]
    rounds = [[tuple(n.name for n in link) for link in r] for r in preflight_links.plan(gpu_nodes)]
    assert rounds[0] == [(f"n{i}",) for i in range(1, 6)]  # every node's GPUs among themselves, at once
    pairs = [pair for r in rounds[1:] for pair in r]  # a ring: each node in two pairs
    assert sorted(pairs) == [("n1", "n2"), ("n2", "n3"), ("n3", "n4"), ("n4", "n5"), ("n5", "n1")]
    for r in rounds[1:]:
        names = [name for pair in r for name in pair]
        assert len(names) == len(set(names)), r


def test_a_node_whose_every_pair_is_slow_is_named_and_a_lone_slow_pair_is_named_as_a_pair():
    h100 = "NVIDIA H100 80GB HBM3"
    devices = {f"n{i}": h100 for i in range(1, 5)}
    ring = [_link("n1", "n2", 180), _link("n2", "n3", 40), _link("n3", "n4", 45), _link("n4", "n1", 185)]
    rows = preflight_links.verdicts(ring, devices, 0.8)
    assert [r["slow"] for r in rows] == [False, True, True, False]
    assert rows[1]["why"].startswith("all-reduce 40 GB/s is 22% of the fastest node pair's 185")
    assert rows[0]["busbw_gb_per_s_of_table"] == pytest.approx(180 / 50)  # one 400 Gb/s NIC per H100
    assert preflight_links.blamed(rows) == ({"n3"}, [])  # both of n3's pairs slow; n2 and n4 each have a good one
    # Sockets where InfiniBand was meant: every pair alike, far below one NIC: slow against the table.
    sockets = preflight_links.verdicts([_link("n1", "n2", 2.0), _link("n2", "n1", 2.1)], devices, 0.8)
    assert all(r["slow"] and "of the table's one NIC 50" in r["why"] for r in sockets)
    assert preflight_links.blamed(sockets) == ({"n1", "n2"}, [])
    # One slow pair among good ones names no node; a failed all-reduce is slow with its error.
    lone = preflight_links.verdicts([_link("n1", "n2", 100), _link("n2", "n3", 180), _link("n3", "n1", 185),
                                     _link("n4", None, None, 8, "Connection refused")], devices, 0.8)
    assert preflight_links.blamed(lone) == ({"n4"}, ["n1<->n2"])
    assert lone[3]["why"] == "the all-reduce failed: Connection refused"
    # Inside a node, NVLink's 450 GB/s each way is the table's figure; CPU links have none.
    (inside,) = preflight_links.verdicts([_link("n1", None, 200.0, 8)], devices, 0.8)
    assert inside["slow"] and "of the table's NVLink 450" in inside["why"]
    (cpu,) = preflight_links.verdicts([_link("a", "b", 1.0)], {}, 0.8)
    assert cpu["busbw_gb_per_s_of_table"] is None and not cpu["slow"]


def test_the_summary_and_the_report_show_the_links(tmp_path, capsys):
    from raybench.cli.main import main

    devices = preflight.verdicts([_device("n1", 700, 3000, index=i) for i in range(2)] +
                                 [_device("n2", 700, 3000, index=i) for i in range(2)])
    links = preflight_links.verdicts([_link("n1", None, 400, 2), _link("n2", None, 420, 2),
                                      _link("n1", "n2", 3.0, 4)], {"n1": devices[0]["device"],
                                                                   "n2": devices[0]["device"]}, 0.8)
    rows = [{"cluster": "c", "job_id": "7", "checked_at": "2026-12-07T18:00:00+00:00", **r} for r in devices + links]
    lines = preflight.summary(rows)
    assert "  n1<->n2 (4 ranks): all-reduce 3 GB/s bus  SLOW: all-reduce 3 GB/s is 6% of the table's one NIC 50" in lines
    assert lines[-1].startswith("slow link(s): n1<->n2 (no node to blame")
    health.save_check(tmp_path, rows)
    glob = str(tmp_path / health.HEALTH_DIR / "*.parquet")
    read = duckdb.sql(f"select node, peer_node, busbw_gb_per_s, slow from read_parquet('{glob}') where link is not null "
                      "order by node, peer_node nulls first").fetchall()
    assert read == [("n1", None, 400.0, False), ("n1", "n2", 3.0, True), ("n2", None, 420.0, False)]
    assert main(["report", str(tmp_path)]) == 0
    section = capsys.readouterr().out.split("Cluster health")[1]
    assert "n1<->n2" in section and "n1 inside" in section and "of the table's one NIC" in section
