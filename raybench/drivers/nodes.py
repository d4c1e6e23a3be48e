"""The Ray nodes under a sweep: which are alive, which were lost and why, and whether a trial still fits on the
nodes that remain.

A node can die mid-sweep (its raylet killed, the machine gone). Ray then fails the trial that ran on it with a
generic worker error and leaves a trial that needs more nodes than remain waiting for resources until
`resources.timeout_s`. raybench names the lost node in the failed trial's row (`NodeLost`) and ends a trial that
cannot fit on the alive nodes at once (`NotEnoughNodes`): its row says "not enough nodes", and the next run of the
sweep on a healed cluster runs it. `raybench cluster status` lists the nodes the same way (`cluster_nodes`).

Ray is imported inside functions only (Ray fixes its auth mode when it is first imported; see ray_cluster).
"""

from __future__ import annotations

import math
import socket
import sys
import time
from dataclasses import asdict, dataclass

# The sbatch template labels every Ray node with the SLURM node it runs on (`ray start --labels`).
SLURM_NODE_LABEL = "slurm_node"
# How long a failed trial on a multi-node cluster waits for the GCS to declare a node dead: Ray's health checks
# take up to ~15 s with its defaults (3 s period, 5 misses); the sbatch template makes them ~5 s.
LOST_NODE_WAIT_S = 20.0
POLL_S = 0.5
# How often a trial driver waiting on Ray (a running trial, a placement group, a pool lease) checks that the trial
# still fits the alive nodes.
NODE_CHECK_S = 2.0
# Text of a failure that a lost process or connection can cause (a rank killed with its node, a collective
# whose peer vanished): only those wait for a node's death to be declared, so an ordinary error row is not slower.
# Ray Train's ControllerError covers a worker lost while its group starts ("failed to initialize").
LOST_PROCESS_MARKERS = ("died", "Died", "Crashed", "onnection", "unexpected", "Unavailable", "gloo", "NCCL",
                         "Socket", "socket", "RaySystemError", "ControllerError", "failed to initialize")


class NodeLost(RuntimeError):
    """A trial failed because a Ray node it ran on, or needed, is gone. The first line of the message is the
    row's message; the lines after it, the failure as Ray reported it."""


class NotEnoughNodes(NodeLost):
    """A trial needs more nodes than the cluster still has alive: it ends at once rather than waiting out its
    timeout for resources that will not come back."""


@dataclass(frozen=True)
class Node:
    node_id: str
    name: str  # the SLURM node name where the template labelled it, else Ray's node name (its IP)
    ip: str
    alive: bool
    cpus: float
    gpus: float
    cause: str = ""  # why Ray declared the node dead ("" while alive)

    def describe(self) -> str:
        where = self.name if self.name == self.ip else f"{self.name} ({self.ip})"
        return f"{where}, Ray node {self.node_id[:8]}" + (f": {self.cause}" if self.cause else "")


def from_ray(info: dict) -> Node:
    """A Node from one entry of `ray.nodes()`."""
    resources = info.get("Resources") or {}
    ip = info.get("NodeManagerAddress") or "?"
    cause = info.get("DeathReasonMessage") or str(info.get("DeathReason") or "")
    return Node(node_id=info.get("NodeID", ""), name=(info.get("Labels") or {}).get(SLURM_NODE_LABEL) or ip,
                ip=ip, alive=bool(info.get("Alive")), cpus=resources.get("CPU", 0.0),
                gpus=resources.get("GPU", 0.0), cause="" if info.get("Alive") else cause or "no reason given")


def current() -> list[Node]:
    """The nodes of the Ray cluster this process is connected to, dead ones included."""
    import ray

    return [from_ray(info) for info in ray.nodes()]


def workers_that_fit(alive: list[Node], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers of this size the alive nodes can hold at most (each worker on one node)."""
    total = 0
    for node in alive:
        fits = math.floor(node.cpus / cpus_per_worker) if cpus_per_worker else math.inf
        if gpus_per_worker:
            fits = min(fits, math.floor(node.gpus / gpus_per_worker))
        total += fits
    return total


def shortfall(workers: int, cpus_per_worker: float, gpus_per_worker: float, nodes: list[Node]) -> str | None:
    """Why `workers` workers of this size cannot run on the alive nodes ("not enough nodes: …"), or None."""
    alive = [n for n in nodes if n.alive]
    room = workers_that_fit(alive, cpus_per_worker, gpus_per_worker)
    if room >= workers:
        return None
    size = f"{cpus_per_worker:g} CPU" + (f" + {gpus_per_worker:g} GPU" if gpus_per_worker else "")
    lost = [n.describe() for n in nodes if not n.alive]
    return (f"not enough nodes: the trial needs {workers} worker(s) of {size}; the {len(alive)} alive Ray node(s) "
            f"hold {room:g}" + (f" (lost: {'; '.join(lost)})" if lost else "")
            + "; run the sweep again once the cluster has its nodes back")


def check_fits(workers: int, cpus_per_worker: float, gpus_per_worker: float,
               alive_at_start: set[str] | None = None) -> set[str]:
    """The ids of the alive nodes, when the trial fits on them. Otherwise raises NodeLost when a node alive at
    the trial's start is gone (the trial ran on it or waited for it), else NotEnoughNodes."""
    nodes = current()
    why = shortfall(workers, cpus_per_worker, gpus_per_worker, nodes)
    if why is None:
        return {n.node_id for n in nodes if n.alive}
    gone = lost_since(alive_at_start or set(), nodes)
    if gone:
        raise NodeLost(f"Ray node {gone[0].describe()} was lost during the trial; {why}")
    raise NotEnoughNodes(why)


def lost_since(alive_ids: set[str], nodes: list[Node]) -> list[Node]:
    """The nodes among `alive_ids` that are now dead."""
    return [n for n in nodes if n.node_id in alive_ids and not n.alive]


def lost_during(failure: str, alive_at_start: set[str], wait_s: float = LOST_NODE_WAIT_S) -> list[Node]:
    """The nodes alive at a trial's start that are gone after it failed with `failure` (its text). A process on a
    lost node fails before the GCS declares the node dead, so this waits up to `wait_s` for that; only on a
    multi-node cluster and for a failure a lost process can cause (one node: the driver's own is alive)."""
    if len(alive_at_start) < 2 or not any(m in failure for m in LOST_PROCESS_MARKERS):
        return []
    deadline = time.monotonic() + wait_s
    while not (gone := lost_since(alive_at_start, current())) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return gone


def lost_message(gone: list[Node], failure: str) -> str:
    """A NodeLost's text: the lost nodes on its first line (the row's message), then the failure Ray reported."""
    names = "; ".join(n.describe() for n in gone)
    return f"Ray node {names} was lost during the trial (the trial failed with it)\n{failure}"


def cluster_nodes(address: str) -> list[dict]:
    """The nodes of the Ray cluster at `address` as plain dicts (`raybench cluster status`). The caller has put
    the cluster's token in the environment (slurm.connect) before Ray was first imported."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        return [asdict(node) for node in current()]
    finally:
        ray.shutdown()


# What a node's `ray start` line names when one of its ports is taken; `cluster up` reports this line alone.
PORT_IN_USE = "raybench: port {ports} on {node} already in use"


def ports_in_use(ports: list[int]) -> list[int]:
    """The ports of `ports` something on this host already listens on (a bind to them fails)."""
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As Ray's servers bind: a port whose connections linger in TIME_WAIT is free to them, a listener's not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError:
                taken.append(port)
    return taken


if __name__ == "__main__" and sys.argv[1:2] == ["check-ports"]:
    # Before a node's `ray start` (cluster_yaml/raybench.sbatch.tmpl): a taken port would end in Ray's GCS traceback.
    if taken := ports_in_use([int(p) for p in sys.argv[3:]]):
        sys.exit(PORT_IN_USE.format(ports=", ".join(map(str, taken)), node=sys.argv[2]) +
                 " (another Ray or service): give the cluster another port block, `raybench cluster up NAME --port P` "
                 "(node i uses P+1000*i ... P+1000*i+999)")
