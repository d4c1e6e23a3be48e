"""The pre-flight's links: the all-reduce bus bandwidth among each node's GPUs (NVLink, or PCIe where a node has
none), and across each pair of neighbouring nodes (the network), held against the other links of the cluster and
the hardware table. A collective on a fallback transport (sockets where InfiniBand was meant, the host where
NVLink was) runs at a fraction of the link's rate, and every trial that crosses it is slowed alike, so their
comparison says nothing about the configurations.

Nodes are paired in a ring (each with the next in name order), so that with three nodes or more each node is in
two pairs: a node whose every pair is slow is named, one slow pair alone is named as a pair. With two nodes the
one pair is held to the table only. Links of one round share no node and are measured at once, as trials run.

Ray is imported inside functions only (see ray_cluster).
"""

from __future__ import annotations

from raybench.drivers import nodes
from raybench.spec import hardware

INSIDE, PAIR = "inside node", "node pair"
# A link below this fraction of its table figure is slow even with no faster link to compare with: inside a node
# the NVLink rate each way (healthy NCCL all-reduces reach 70-90% of it), across nodes one NIC's rate (a pair of
# nodes all-reduces over all of their NICs: reaching less than half of one is a fallback, sockets reach a few %).
TABLE_FLOOR = 0.5


class _LinkRank:
    """One process of a link's all-reduce, on the node and device Ray gave it."""

    def gpu(self) -> int | None:
        import ray

        ids = ray.get_gpu_ids()
        return int(ids[0]) if ids else None

    def rendezvous(self, host: str) -> str:
        from raybench.runtime import preflight

        return preflight.rendezvous(host)

    def bus_bandwidth(self, rank: int, world_size: int, init_method: str, gpu: int | None,
                      node_gpus: list[int] | None) -> float:
        from raybench.runtime import preflight

        return preflight.link_bus_bandwidth(rank, world_size, init_method, gpu, node_gpus)


def plan(alive: list[nodes.Node]) -> list[list[tuple[nodes.Node, ...]]]:
    """Rounds of links, none of a round sharing a node: first every node of 2 GPUs or more on its own, then the
    ring of pairs (one pair for two nodes)."""
    ordered = sorted(alive, key=lambda n: n.name)
    inside = [(n,) for n in ordered if n.gpus >= 2]
    count = len(ordered) if len(ordered) > 2 else len(ordered) - 1
    rounds: list[list[tuple[nodes.Node, ...]]] = []
    for pair in [(ordered[i], ordered[(i + 1) % len(ordered)]) for i in range(max(count, 0))]:
        ids = {n.node_id for n in pair}
        free = next((r for r in rounds if not ids & {n.node_id for link in r for n in link}), None)
        if free is None:
            rounds.append([pair])
        else:
            free.append(pair)
    return ([inside] if inside else []) + rounds


def measure(rounds: list[list[tuple[nodes.Node, ...]]], wait) -> list[dict]:
    """Each link's bus bandwidth, a round at a time; `wait(refs)` is the pre-flight's busy-aware ray.get."""
    rows = []
    for links in rounds:
        rows += _measure_round(links, wait)
    return rows


def _measure_round(links: list[tuple[nodes.Node, ...]], wait) -> list[dict]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def rank(node: nodes.Node):
        size = {"num_gpus": 1, "num_cpus": 0} if node.gpus else {"num_cpus": 1}
        pinned = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return node, ray.remote(_LinkRank).options(scheduling_strategy=pinned, **size).remote()

    groups = [[rank(node) for node in link for _ in range(int(node.gpus) or 1)] for link in links]
    try:
        gpus = [wait([actor.gpu.remote() for _, actor in group]) for group in groups]
        started = [_start(group, gpu_ids, wait) for group, gpu_ids in zip(groups, gpus)]
        return [_row(link, group, ref) for link, group, ref in zip(links, groups, started)]
    finally:
        for group in groups:
            for _, actor in group:
                ray.kill(actor)


def _start(group: list, gpu_ids: list[int | None], wait) -> list:
    """Every rank of one link's all-reduce started, meeting at a port of the first rank's node: their refs."""
    head, head_actor = group[0]
    (address,) = wait([head_actor.rendezvous.remote(head.ip)])
    on_node = {}
    for (node, _), gpu in zip(group, gpu_ids):
        on_node.setdefault(node.node_id, []).append(gpu)
    return [actor.bus_bandwidth.remote(i, len(group), address, gpu, on_node[node.node_id] if gpu is not None else None)
            for i, ((node, actor), gpu) in enumerate(zip(group, gpu_ids))]


def _row(link: tuple[nodes.Node, ...], group: list, refs: list) -> dict:
    import ray

    row = {"node": link[0].name, "ray_node_id": link[0].node_id, "peer_node": link[1].name if len(link) > 1 else None,
           "link": PAIR if len(link) > 1 else INSIDE, "link_ranks": len(group), "busbw_gb_per_s": None,
           "link_error": None}
    try:
        row["busbw_gb_per_s"] = ray.get(refs)[0]  # rank 0's: every rank times the same collectives
    except Exception as err:  # noqa: BLE001 - a link that fails is a finding, the check goes on
        row["link_error"] = str(err).strip().splitlines()[-1][:300]
    return row


def verdicts(measured: list[dict], devices: dict[str, str], tolerance: float) -> list[dict]:
    """Each link's bus bandwidth as a fraction of the fastest link of its kind (same link, same device) and of the
    table, and whether it is slow and why. `devices`: node name -> its device name ("cpu" for a CPU node)."""
    def kind(m: dict) -> tuple[str, str]:
        return m["link"], devices.get(m["node"], "cpu")

    fastest = {}
    for m in measured:
        if m["busbw_gb_per_s"] is not None:
            fastest[kind(m)] = max(fastest.get(kind(m), 0.0), m["busbw_gb_per_s"])
    rows = []
    for m in measured:
        value, device = m["busbw_gb_per_s"], devices.get(m["node"], "cpu")
        table = _table(m["link"], device)
        of_fastest = None if value is None else value / fastest[kind(m)]
        of_table = None if value is None or not table else value / table
        why = [f"the all-reduce failed: {m['link_error']}"] if value is None else []
        if of_fastest is not None and of_fastest < tolerance:
            why.append(f"all-reduce {value:.3g} GB/s is {of_fastest:.0%} of the fastest {m['link']}'s "
                       f"{fastest[kind(m)]:.3g}")
        if of_table is not None and of_table < TABLE_FLOOR:
            what = "NVLink" if m["link"] == INSIDE else "one NIC"
            why.append(f"all-reduce {value:.3g} GB/s is {of_table:.0%} of the table's {what} {table:.3g}")
        rows.append({**m, "device": device, "tolerance": tolerance, "busbw_gb_per_s_of_fastest": of_fastest,
                     "busbw_gb_per_s_of_table": of_table, "slow": bool(why), "why": "; ".join(why) or None})
    return rows


def _table(link: str, device: str) -> float | None:
    nominal = hardware.nominal_link(device) if device != "cpu" else None
    if nominal is None:
        return None
    return nominal.nvlink_gbps if link == INSIDE else nominal.nic_gbps


def blamed(rows: list[dict]) -> tuple[set[str], list[str]]:
    """The nodes the slow links name (a slow link inside a node; a node whose two pairs or more are all slow) and
    the slow pairs that name no node ("a<->b")."""
    pairs = [r for r in rows if r.get("link") == PAIR]
    nodes_named = {r["node"] for r in rows if r.get("link") == INSIDE and r["slow"]}
    for name in {n for r in pairs for n in (r["node"], r["peer_node"])}:
        own = [r for r in pairs if name in (r["node"], r["peer_node"])]
        if len(own) >= 2 and all(r["slow"] for r in own):
            nodes_named.add(name)
    lone = [f"{r['node']}<->{r['peer_node']}" for r in pairs
            if r["slow"] and not {r["node"], r["peer_node"]} & nodes_named]
    return nodes_named, lone
