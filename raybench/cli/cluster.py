"""The CLI of warm clusters on SLURM (hooked into raybench.cli.main): `raybench cluster up | status | check | down`,
and the SLURM options `cluster up` and `slurm submit` share."""

from __future__ import annotations

import json

from raybench.drivers import preflight, slurm
from raybench.drivers.slurm import SlurmOptions
from raybench.results.store import DEFAULT_STORE
from raybench.spec.errors import ConfigError, Problem

EXIT_OK, EXIT_NOT_OK = 0, 1


def add_slurm_options(p) -> None:
    p.add_argument("--nodes", type=int, default=1, help="nodes (Ray head on the first, a worker on each other)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (sbatch --gpus-per-node)")
    p.add_argument("--cpus-per-node", type=int, help="CPUs per node (default: the partition's default)")
    p.add_argument("--mem", help="memory per node, e.g. 200G (default: the partition's default)")
    p.add_argument("--time", default="01:00:00", help="time limit, e.g. 30, 02:00:00, 1-00:00:00")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--account", help="SLURM account")
    p.add_argument("--container-cmd", help="prefix for ray and raybench, e.g. 'apptainer exec --nv img.sif'")
    p.add_argument("--port", type=int, default=6379,
                   help="Ray GCS port; node i uses port+1000*i … port+1000*i+999 (default 6379)")


def slurm_options(args) -> SlurmOptions:
    return SlurmOptions(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
                        mem=args.mem, time=args.time, partition=args.partition, account=args.account,
                        container_cmd=args.container_cmd, port=args.port)


def _up(args) -> int:
    _check_tolerance(args.tolerance)
    record = slurm.cluster_up(args.name, slurm_options(args), ready_timeout=args.ready_timeout)
    print(f"cluster {args.name} up: job {record['job_id']}, address {record['address']}; "
          f"run sweeps with `raybench run SWEEP --cluster {args.name}`", flush=True)
    if not args.no_check:  # the cluster is up whatever the check finds: a slow node is named (or left out)
        _check_and_store(args.name, record["job_id"], args)
    return EXIT_OK


def _check(args) -> int:
    _check_tolerance(args.tolerance)
    return _check_and_store(args.name, slurm.load_record(args.name)["job_id"], args)


def _check_and_store(name: str, job_id: str, args) -> int:
    """The pre-flight on the named cluster: its lines printed, its rows stored, the slow nodes left out with
    --exclude-slow; exit 1 when a slow node stays in the cluster."""
    from raybench.drivers.ray_cluster import ray_cluster

    address = slurm.connect(name)  # before Ray is imported: the cluster's token
    with ray_cluster(address):
        try:
            lines, kept = preflight.check_and_store(name, job_id, args.store, args.tolerance, args.exclude_slow)
        except preflight.ClusterBusy as busy:
            print(f"pre-flight of cluster {name}: not run: {busy}")
            return EXIT_NOT_OK
    print("\n".join(lines))
    return EXIT_NOT_OK if kept else EXIT_OK


def submit_check(args) -> list[str] | None:
    """`slurm submit`'s pre-flight in its job (drivers/preflight.main); None with --no-check."""
    return None if args.no_check else preflight.job_command(args.tolerance, args.exclude_slow)


def tolerance_problems(tolerance: float) -> list[Problem]:
    if 0 < tolerance <= 1:
        return []
    return [Problem("--tolerance", tolerance, "must be a fraction in (0, 1]: a device below that fraction of the "
                                              f"fastest of its kind is slow (default {preflight.TOLERANCE})")]


def _check_tolerance(tolerance: float) -> None:
    if problems := tolerance_problems(tolerance):
        raise ConfigError("raybench cluster", problems)


def _status(args) -> int:
    status = slurm.cluster_status(args.name)
    print(json.dumps(status) if args.json else status_text(status))
    return EXIT_OK if status["state"] != "GONE" else EXIT_NOT_OK


def status_text(status: dict) -> str:
    """`cluster status` as a line, then one line per Ray node: a node lost mid-sweep is named with Ray's reason."""
    ended = f" (its allocation ended: {status['ended']})" if status.get("ended") else ""
    lines = [f"cluster {status['name']}: job {status['job_id']} {status['state']}{ended}, "
             f"address {status['address'] or '-'}"]
    if status.get("nodes_error"):
        lines.append(f"  Ray nodes: cannot ask the cluster ({status['nodes_error']})")
    for node in status.get("nodes") or ():
        where = node["name"] if node["name"] == node["ip"] else f"{node['name']} ({node['ip']})"
        lines.append(f"  node {where}: " + ("alive" if node["alive"] else f"GONE ({node['cause']})"))
    if any(not node["alive"] for node in status.get("nodes") or ()):
        lines.append("  degraded: trials that need the lost nodes end as 'not enough nodes'; "
                     f"`raybench cluster down {status['name']}` and `up` again to heal it")
    return "\n".join(lines)


def _down(args) -> int:
    job_id = slurm.cluster_down(args.name, timeout=args.timeout)
    print(f"cluster {args.name} down (job {job_id} ended)")
    return EXIT_OK


def _add_check_options(p) -> None:
    p.add_argument("--store", default=DEFAULT_STORE, help=f"store the pre-flight's rows go to ({DEFAULT_STORE})")
    add_verdict_options(p)


def add_verdict_options(p) -> None:
    """The pre-flight's options that `cluster up`, `cluster check` and `slurm submit` share."""
    p.add_argument("--tolerance", type=float, default=preflight.TOLERANCE,
                   help=f"a device below this fraction of the fastest of its kind is slow ({preflight.TOLERANCE})")
    p.add_argument("--exclude-slow", action="store_true",
                   help="leave the slow nodes out: stop their Ray (not the head's); the cluster goes on without them")


def add_parsers(sub, parser_class) -> None:
    cluster = sub.add_parser("cluster", help="hold a warm Ray cluster on a SLURM allocation").add_subparsers(
        dest="cluster_command", required=True, parser_class=parser_class)
    p = cluster.add_parser("up", help="submit a job holding a Ray cluster; wait until it is up; check its nodes")
    p.add_argument("name")
    add_slurm_options(p)
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for the cluster (900)")
    p.add_argument("--no-check", action="store_true", help="skip the pre-flight of every node (`cluster check`)")
    _add_check_options(p)
    p.set_defaults(func=_up)
    p = cluster.add_parser("status", help="the cluster's job state and address")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)
    p = cluster.add_parser("check", help="measure every node's devices (matmul, memory, host-to-device copy) and "
                                         "name the slow ones; exit 1 when one is")
    p.add_argument("name")
    _add_check_options(p)
    p.set_defaults(func=_check)
    p = cluster.add_parser("down", help="scancel the cluster's job and wait until every process is gone")
    p.add_argument("name")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the job to end (300)")
    p.set_defaults(func=_down)
