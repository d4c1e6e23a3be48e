"""The pre-flight: before a cluster's trials are trusted, every device of every node is measured
(runtime/preflight.py: matmul rate, memory copy bandwidth, host-to-device copy) and held against the fastest
device of its kind in the cluster and against the hardware table. A device below the tolerance of the fastest
in any figure is named slow, with what is slow: one node held at lower clocks, power-capped, or sharing its cores
with other work makes every comparison of the trials that touch it wrong.

Rows, one per device, go to the store (results/health.py) so `raybench report` shows the cluster's health beside
its trials. Then the links: the all-reduce bus bandwidth inside each node of 2 GPUs or more and across pairs of
nodes (drivers/preflight_links.py). `--exclude-slow` leaves a slow node out of a warm cluster (`leave_out`): its Ray
is stopped and the cluster goes on, degraded, on the other nodes, as after a lost node.

Ray is imported inside functions only (Ray fixes its auth mode when it is first imported; see ray_cluster).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

from raybench.drivers import nodes, preflight_links
from raybench.drivers.slurm import slurm_command
from raybench.results import health
from raybench.spec import hardware

# A device below this fraction of the fastest device of its kind, in any figure, is slow. Healthy devices of one
# kind agree within a few percent on these figures; a 20% gap is a device held back, not noise.
TOLERANCE = 0.8
# A GPU below this fraction of its hardware table figure is slow even when every GPU of the cluster is (a cluster
# of one node, all of its GPUs capped alike). Healthy GPUs reach 70-90% of their table's peak on these kernels; half
# of it is a device held back. A tighter bound waits for a GPU round to measure the healthy fraction.
TABLE_FLOOR = 0.5
# A device the pre-flight waits for longer than this is held by trials (a warm pool's actors keep theirs).
BUSY_TIMEOUT_S = 120.0
FIGURES = ("matmul_tflops", "memory_gb_per_s", "host_to_device_gb_per_s")
FIGURE_NAMES = {"matmul_tflops": "matmul", "memory_gb_per_s": "memory copy",
                "host_to_device_gb_per_s": "host-to-device copy"}


def table_figures(device: str) -> dict[str, float | None]:
    """What the hardware table says the device gives (peaks, not what a kernel reaches); None where it says
    nothing (CPUs, a GPU the table lacks)."""
    if not hardware.known_gpu(device):
        return dict.fromkeys(FIGURES)
    bandwidth = hardware.memory_bandwidth_tb_per_s(device)
    return {"matmul_tflops": hardware.peak_tflops(device, "bf16"),
            "memory_gb_per_s": bandwidth * 1000 if bandwidth else None,
            "host_to_device_gb_per_s": hardware.host_link_gb_per_s(device)}


def verdicts(measured: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """Each measured device's figures as fractions of the fastest device of its kind and of the table, and
    whether it is slow (`slow`) and why (`why`: what is slow, by how much)."""
    fastest = {(m["device"], f): max(x[f] for x in measured if x["device"] == m["device"] and x[f] is not None)
               for m in measured for f in FIGURES if m[f] is not None}
    rows = []
    for m in measured:
        table = table_figures(m["device"])
        row, why = {**m, "tolerance": tolerance}, []
        for f in FIGURES:
            value = m[f]
            of_fastest = None if value is None else value / fastest[m["device"], f]
            of_table = None if value is None or not table[f] else value / table[f]
            row[f"{f}_of_fastest"], row[f"{f}_of_table"] = of_fastest, of_table
            if of_fastest is not None and of_fastest < tolerance:
                why.append(f"{FIGURE_NAMES[f]} {value:.3g} is {of_fastest:.0%} of the fastest {m['device']}'s "
                           f"{fastest[m['device'], f]:.3g}")
            if of_table is not None and of_table < TABLE_FLOOR:
                why.append(f"{FIGURE_NAMES[f]} {value:.3g} is {of_table:.0%} of the table's {table[f]:.3g}")
        rows.append({**row, "slow": bool(why), "why": "; ".join(why) or None})
    return rows


def _measure_remote():
    """The Ray task that measures one device where it runs (the GPU Ray gave it, else the host)."""
    import ray
    import torch

    from raybench.runtime import preflight

    gpu_ids = ray.get_gpu_ids()
    device = torch.device("cuda", 0) if gpu_ids else torch.device("cpu")  # Ray shows the task its GPU as 0
    figures = preflight.measure(device)
    return {**figures, "device_index": int(gpu_ids[0]) if gpu_ids else None}


def measure_cluster(alive: list[nodes.Node]) -> list[dict]:
    """Every device of the `alive` nodes of the Ray cluster this process is connected to, all at once, as a trial
    runs them: what slows the whole cluster for a moment slows every device alike, and the comparison holds."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    places = []
    for node in sorted(alive, key=lambda n: n.name):
        pinned = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        size = {"num_gpus": 1, "num_cpus": 0} if node.gpus else {"num_cpus": 1}
        places += [(node, {"scheduling_strategy": pinned, **size})] * (int(node.gpus) or 1)
    # Start every device's worker and import torch there first, so that the measurements, in the same (now warm)
    # workers, start together rather than as each worker gets through its imports.
    _get([ray.remote(_import_torch).options(**options).remote() for _, options in places])
    started = [(node, ray.remote(_measure_remote).options(**options).remote()) for node, options in places]
    figures = _get([ref for _, ref in started])
    return [{"node": node.name, "ray_node_id": node.node_id, **f} for (node, _), f in zip(started, figures)]


class ClusterBusy(RuntimeError):
    """The pre-flight could not have every device: trials (a warm pool's actors) hold them."""


def _get(refs: list) -> list:
    import ray

    timeout_s = BUSY_TIMEOUT_S
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if waiting:
        for ref in waiting:
            ray.cancel(ref, force=True)
        raise ClusterBusy(f"the pre-flight waited {timeout_s:.0f} s for {len(waiting)} of {len(refs)} device(s), held "
                          "by trials (a warm pool's actors hold theirs between sweeps); check again when the cluster "
                          "is idle")
    return ray.get(refs)


def _import_torch() -> None:
    import torch  # noqa: F401


def check(cluster: str | None, job_id: str | None, tolerance: float = TOLERANCE) -> list[dict]:
    """The pre-flight's rows for the connected Ray cluster, its devices' then its links': measured, judged,
    stamped."""
    checked_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    alive = [n for n in nodes.current() if n.alive]
    devices = verdicts(measure_cluster(alive), tolerance)
    links = preflight_links.measure(preflight_links.plan(alive), _get)
    links = preflight_links.verdicts(links, {r["node"]: r["device"] for r in devices}, tolerance)
    return [{"cluster": cluster, "job_id": job_id, "checked_at": checked_at, **row} for row in devices + links]


def slow_nodes(rows: list[dict]) -> list[str]:
    """The nodes a check names: a device of theirs slow, or their links (preflight_links.blamed)."""
    named, _ = preflight_links.blamed(rows)
    return sorted({r["node"] for r in rows if r["slow"] and not r.get("link")} | named)


def summary(rows: list[dict]) -> list[str]:
    """Lines for the terminal: one per device, one per link, then the verdict naming the slow nodes and links."""
    lines = []
    for r in rows:
        if r.get("link"):
            where = f"{r['node']}<->{r['peer_node']}" if r["peer_node"] else f"{r['node']} inside"
            figure = "failed" if r["busbw_gb_per_s"] is None else f"{r['busbw_gb_per_s']:.3g} GB/s bus"
            lines.append(f"  {where} ({r['link_ranks']} ranks): all-reduce {figure}" +
                         (f"  SLOW: {r['why']}" if r["slow"] else ""))
            continue
        where = r["node"] + (f" gpu{r['device_index']}" if r["device_index"] is not None else "")
        figures = f"matmul {r['matmul_tflops']:.3g} TFLOP/s, memory {r['memory_gb_per_s']:.3g} GB/s"
        if r["host_to_device_gb_per_s"] is not None:
            figures += f", host-to-device {r['host_to_device_gb_per_s']:.3g} GB/s"
        lines.append(f"  {where} ({r['device']}): {figures}" + (f"  SLOW: {r['why']}" if r["slow"] else ""))
    slow, (_, pairs) = slow_nodes(rows), preflight_links.blamed(rows)
    verdict = [f"slow node(s): {', '.join(slow)}"] if slow else []
    verdict += [f"slow link(s): {', '.join(pairs)} (no node to blame: check both ends' network)"] if pairs else []
    if verdict:
        lines.append("; ".join(verdict) + "; leave them out of the allocation (sbatch --exclude) or let them recover, "
                     "then check again")
    elif rows:
        nodes_checked = len({r["node"] for r in rows if not r.get("link")})
        lines.append(f"all {nodes_checked} node(s) within {rows[0]['tolerance']:.0%} of the fastest of their kind")
    else:
        lines.append("no alive node to check")
    return lines


def leave_out(job_id: str, rows: list[dict], wait_s: float = nodes.LOST_NODE_WAIT_S) -> tuple[list[str], list[str]]:
    """Stop the Ray of every slow node of the cluster's job but the head's, and wait until Ray has them dead: the
    cluster goes on with the others (a trial that needs more nodes ends as "not enough nodes"). Returns the nodes
    left out and the slow ones kept (the head: without it there is no cluster)."""
    slow = slow_nodes(rows)
    nodelist = slurm_command("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()
    hosts = slurm_command("scontrol", "show", "hostnames", nodelist).stdout.split()
    out = [node for node in slow if node in hosts[1:]]
    for node in out:
        # The node's `ray start --block` (cluster_yaml/raybench.sbatch.tmpl, its temp dir /tmp/rbs-JOB-INDEX) stops
        # its node's Ray on SIGTERM. "[d]" keeps the pattern from matching pkill's own command line.
        pattern = f"--temp-[d]ir=/tmp/rbs-{job_id}-{hosts.index(node)}( |$)"
        slurm_command("srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
               "pkill", "-TERM", "-f", "--", pattern)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(n.alive for n in nodes.current() if n.name in out):
        time.sleep(nodes.POLL_S)
    return out, [node for node in slow if node not in out]



def check_and_store(cluster: str, job_id: str, store: str, tolerance: float,
                    exclude_slow: bool) -> tuple[list[str], list[str]]:
    """The pre-flight of the Ray cluster this process is connected to (SLURM job `job_id`): its rows stored, the
    slow nodes left out when `exclude_slow`. Returns the lines to print and what stays slow in the cluster (its
    nodes, and slow node pairs that name no node). Raises ClusterBusy when trials hold its devices."""
    rows = check(cluster, job_id, tolerance)
    out, kept = leave_out(job_id, rows) if exclude_slow else ([], slow_nodes(rows))
    path = health.save_check(store, rows)
    lines = [f"pre-flight of cluster {cluster} (stored in {path}):", *summary(rows)]
    lines += [f"left out: {', '.join(out)} (its Ray stopped; the cluster goes on without it)"] if out else []
    lines += [f"kept: {', '.join(kept)}, the Ray head's node (without it there is no cluster): bring the cluster up "
              "again without it (sbatch --exclude)"] if exclude_slow and kept else []
    return lines, kept + preflight_links.blamed(rows)[1]


def job_command(tolerance: float, exclude_slow: bool) -> list[str]:
    """The arguments after `python` of a one-shot job's pre-flight (main below, which `--store` completes), run
    on its cluster before the sweep."""
    return ["-m", "raybench.drivers.preflight", "--tolerance", str(tolerance),
            *(["--exclude-slow"] if exclude_slow else [])]


def main(argv: list[str] | None = None) -> int:
    """A one-shot SLURM job's pre-flight (`raybench slurm submit`), in the job, on its new cluster: the lines go to
    the job's log, the verdict (prefixed `raybench: `) to `slurm submit --wait`'s too. The sweep runs whatever it
    finds: a slow node is named, or left out with --exclude-slow."""
    from raybench.drivers.ray_cluster import ray_cluster

    parser = argparse.ArgumentParser(prog="python -m raybench.drivers.preflight")
    parser.add_argument("--store", required=True)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--exclude-slow", action="store_true")
    args = parser.parse_args(argv)
    job_id = os.environ["SLURM_JOB_ID"]
    with ray_cluster(os.environ["RAY_ADDRESS"]):
        lines, kept = check_and_store(f"job {job_id}", job_id, args.store, args.tolerance, args.exclude_slow)
    print("\n".join(lines[:-1]))
    print(f"raybench: pre-flight: {lines[-1]}", flush=True)
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
