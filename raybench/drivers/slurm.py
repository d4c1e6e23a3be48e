"""Ray clusters on SLURM allocations: render the sbatch template, submit one-shot sweeps, hold warm clusters.

Everything a job needs lives in a job directory under RAYBENCH_HOME (default ~/.raybench, which must be on a
filesystem every node sees): the rendered script, the per-job Ray auth token (0600), the address file the job
writes once its Ray cluster is up, the SLURM log and, for one-shot sweeps, the sweep's exit code.
A warm cluster is also recorded by name in RAYBENCH_HOME/clusters/NAME.json (0600: it holds the token), which
is where `raybench run --cluster NAME` finds its address and token.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from raybench.drivers import nodes, requeue
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.load import load_sweep

# The template lives in the checkout's cluster_yaml/ (scripts/setup.sh installs raybench editable from it);
# RAYBENCH_SBATCH_TEMPLATE points at a site's own copy.
TEMPLATE = Path(__file__).resolve().parents[2] / "cluster_yaml" / "raybench.sbatch.tmpl"
GONE_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "TIMEOUT"}
# A job in these states holds its allocation, or waits for one; any other state means it is over or ending.
RUNNING_STATES = {"CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "SIGNALING"}
WAITING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
# How often `run --cluster` asks SLURM whether the cluster's allocation still runs (watch_allocation).
WATCH_POLL_S = 2.0
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")  # sbatch --time forms: M, M:S, H:M:S, D-H[:M[:S]]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MEM = re.compile(r"^\d+[KMGT]?$")


class SlurmError(Exception):
    """A SLURM command failed or a job did not do what it should; `exit_code` is the CLI's exit status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class SlurmOptions:
    """What to ask SLURM for; every field is a `raybench slurm submit` / `cluster up` option."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int | None = None  # None: the partition's default
    mem: str | None = None  # sbatch --mem per node (e.g. 64G); None: the partition's default
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    container_cmd: str | None = None  # prefix for ray and raybench commands, e.g. "apptainer exec --nv img.sif"
    port: int = 6379  # Ray GCS port; each node uses the next 999 ports (node i: port + 1000*i + 1 …)
    min_shm_mb: int = 512


def option_problems(opts: SlurmOptions) -> list[Problem]:
    """Every bad option, named as the CLI spells it, with the fix."""
    problems = []
    if opts.nodes < 1:
        problems.append(Problem("--nodes", opts.nodes, "must be at least 1"))
    if opts.gpus_per_node < 0:
        problems.append(Problem("--gpus-per-node", opts.gpus_per_node, "must be 0 (CPU) or more"))
    if opts.cpus_per_node is not None and opts.cpus_per_node < 1:
        problems.append(Problem("--cpus-per-node", opts.cpus_per_node, "must be at least 1 (or leave it out)"))
    if not _TIME.match(opts.time):
        problems.append(Problem("--time", opts.time, "use an sbatch time limit: MINUTES, HH:MM:SS or D-HH:MM:SS"))
    for flag, value in (("--partition", opts.partition), ("--account", opts.account)):
        if value is not None and not _NAME.match(value):
            problems.append(Problem(flag, value, "letters, digits, '_', '.', '-' only"))
    if opts.mem is not None and not _MEM.match(opts.mem):
        problems.append(Problem("--mem", opts.mem, "use an sbatch memory size such as 64G or 200000M"))
    if not 1024 <= opts.port <= 65535 - 1000 * opts.nodes:
        problems.append(Problem("--port", opts.port, f"use 1024 … {65535 - 1000 * opts.nodes}: node i takes "
                                                     "the ports from port + 1000*i to port + 1000*i + 999"))
    if opts.container_cmd is not None:
        try:
            if not shlex.split(opts.container_cmd):
                raise ValueError("empty")
        except ValueError as why:
            problems.append(Problem("--container-cmd", opts.container_cmd,
                                    f"not a shell command line ({why}); e.g. 'apptainer exec --nv image.sif'"))
    return problems


def check_options(opts: SlurmOptions) -> None:
    if problems := option_problems(opts):
        raise ConfigError("slurm options", problems)


def raybench_home() -> Path:
    return Path(os.environ.get("RAYBENCH_HOME") or Path.home() / ".raybench")


def _directives(opts: SlurmOptions) -> str:
    lines = []
    if opts.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={opts.cpus_per_node}")
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    for flag, value in (("mem", opts.mem), ("partition", opts.partition), ("account", opts.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return "\n".join(lines)


def _container(opts: SlurmOptions) -> str:
    return shlex.join(shlex.split(opts.container_cmd)) if opts.container_cmd else ""


def render(opts: SlurmOptions, job_dir: Path, payload: str, template: Path | None = None,
           directives: list[str] = ()) -> str:
    """The sbatch script for `opts`: every {{name}} in the template replaced, an unknown or unused name is a bug.
    `directives`: more #SBATCH lines (a requeued job's)."""
    values = {
        "nodes": str(opts.nodes), "time": opts.time, "directives": "\n".join(filter(None, [_directives(opts), *directives])),
        "job_dir": shlex.quote(str(job_dir)), "port": str(opts.port), "gpus_per_node": str(opts.gpus_per_node),
        "min_shm_mb": str(opts.min_shm_mb), "payload": payload,
        "container": _container(opts),
        "ray": shlex.quote(str(Path(sys.executable).parent / "ray")), "python": shlex.quote(sys.executable),
    }
    text = Path(template or os.environ.get("RAYBENCH_SBATCH_TEMPLATE") or TEMPLATE).read_text()
    used = set(re.findall(r"\{\{(\w+)\}\}", text))
    if used != set(values):
        raise RuntimeError(f"sbatch template placeholders {sorted(used)} do not match {sorted(values)}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


HOLD_PAYLOAD = """# Hold the cluster until scancel (`raybench cluster down`) or the time limit; end if the head's step dies.
# A worker node's step that ends (the node lost) leaves the cluster up, degraded: `raybench cluster status`
# names the node, and trials that need more nodes than remain end at once as "not enough nodes".
if ((${#step_pids[@]} > 1)); then
  wait -n "${step_pids[@]}"
  kill -0 "${step_pids[0]}" 2>/dev/null &&
    echo "raybench: a Ray worker node's step ended; the cluster stays up on the nodes that remain" >&2
fi
wait "${step_pids[0]}"
echo "raybench: the Ray head's step ended; the cluster goes down" >&2
exit 1
"""


def _job_dir(kind: str, name: str) -> Path:
    """A new private job directory with a fresh per-job Ray auth token (0600)."""
    root = raybench_home() / kind
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    job_dir = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    job_dir.mkdir(mode=0o700)
    token = job_dir / "token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    return job_dir


def slurm_command(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: run raybench where the SLURM client commands are on PATH", 2)
    if check and done.returncode:
        raise SlurmError(f"{shlex.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def sbatch(script: str, job_dir: Path, job_name: str) -> str:
    """Submit the rendered script; returns the job id. A rejected job (bad partition, …) is bad input."""
    path = job_dir / "raybench.sbatch"
    path.write_text(script)
    done = slurm_command("sbatch", "--parsable", f"--job-name={job_name}", f"--output={job_dir}/slurm-%j.out",
                  f"--chdir={job_dir}", str(path), check=False)
    if done.returncode:
        raise SlurmError(f"sbatch rejected the job: {done.stderr.strip()}", 2)
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str | None:
    """The job's SLURM state, or None once it has left the queue (finished and purged, or unknown)."""
    state = _squeue_state(job_id)
    return None if not state or state in GONE_STATES else state


def _squeue_state(job_id: str, fields: str = "%T") -> str:
    """The job's state as squeue prints it (TIMEOUT, CANCELLED, … included; `fields`: squeue's format), "" once
    SLURM no longer knows it."""
    for attempt in range(5):
        done = slurm_command("squeue", "--noheader", "--states=all", f"--jobs={job_id}", f"--format={fields}",
                             check=False)
        if done.returncode == 0 or "Invalid job id" in done.stderr:
            break
        time.sleep(2 * attempt + 1)  # slurmctld busy or restarting: a failed query does not mean the job is gone
    else:
        raise SlurmError(f"squeue cannot tell the state of job {job_id}: {done.stderr.strip()}")
    return "" if done.returncode else done.stdout.strip()


def ended_state(job_id: str, running_only: bool = False) -> str | None:
    """How a job's allocation ended (TIMEOUT, CANCELLED, NODE_FAIL, …; while SLURM ends its processes, COMPLETING
    and SLURM's reason, e.g. "COMPLETING (TimeLimit)"; "GONE" once it has left the queue), or None while it is
    pending or running. With `running_only`, a job waiting again (requeued, preempted) has ended too."""
    state, _, reason = _squeue_state(job_id, "%T %r").partition(" ")
    return _ended(state, reason, running_only)


def _ended(state: str, reason: str, running_only: bool = False) -> str | None:
    """ended_state from squeue's state and reason."""
    if state in RUNNING_STATES or (state in WAITING_STATES and not running_only):
        return None
    return f"{state} ({reason})" if state == "COMPLETING" and reason not in ("", "None") else state or "GONE"


def wait_gone(job_id: str, timeout: float | None = None, poll: float = 1.0,
              on_state: Callable[[str], None] | None = None) -> bool:
    """Wait until the job has ended completely (COMPLETING included; a requeued job is not gone: it is pending
    again); False on timeout. `on_state` is called with each new state the job is seen in."""
    deadline = None if timeout is None else time.monotonic() + timeout
    seen = None
    while (state := job_state(job_id)) is not None:
        if on_state is not None and state != seen:
            on_state(state)
        seen = state
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def log_tail(job_dir: Path, lines: int = 30) -> str:
    logs = sorted(job_dir.glob("slurm-*.out"))
    return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:]) if logs else "(no SLURM log)"


def submit(sweep: str, opts: SlurmOptions, store: str | None = None, extra: list[str] = (),
           requeue_signal_s: int | None = None, check: list[str] | None = None, problems=()) -> tuple[str, Path]:
    """One-shot job: allocation → Ray cluster → pre-flight → `raybench run` → rows in the store → exit. With
    `requeue_signal_s` (`--requeue`), the job requeues itself that many seconds before its time limit until the
    sweep is done (raybench.drivers.requeue); each allocation gets its own pre-flight. `check`: the pre-flight's
    arguments after `python` (drivers/preflight.job_command without the store), None for none.

    The sweep is validated here first: a bad sweep or bad options (`problems`: the caller's) raise ConfigError, all
    of them together, and submit nothing. Returns (job id, job dir)."""
    problems = option_problems(opts) + list(problems)
    try:
        spec = load_sweep(sweep)
        trials = plan(spec, keep_invalid="--keep-invalid" in extra, source=sweep)
    except ConfigError as err:  # report the sweep's problems and the options' together
        raise ConfigError(err.source, problems + err.problems) from None
    if requeue_signal_s is not None:
        problems += requeue.fit_problems(trials, opts.time, requeue_signal_s)
    if problems:
        raise ConfigError("slurm options", problems)
    store_path = Path(store or spec.store).resolve()  # the job runs in its own directory
    job_dir = _job_dir("jobs", spec.name)
    run = _run_command(opts, Path(sweep).resolve(), store_path, list(extra))
    payload = _run_payload(run) if requeue_signal_s is None else requeue.payload(run, requeue_signal_s)
    if check is not None:  # a slow node is named (or left out), and the sweep runs whatever the pre-flight finds
        payload = (f"{_container(opts)} {shlex.join([sys.executable, *check, '--store', str(store_path)])} || echo "
                   '"raybench: the pre-flight did not pass (its lines above); the sweep runs" >&2\n' + payload)
    directives = () if requeue_signal_s is None else requeue.directives(requeue_signal_s)
    script = render(opts, job_dir, payload, directives=directives)
    return sbatch(script, job_dir, f"raybench-{spec.name}"), job_dir


def sweep_exit_code(job_id: str, job_dir: Path, on_state: Callable[[str], None] | None = None) -> int:
    """Wait until a one-shot job has left the queue (across its requeues); the exit code of its sweep."""
    wait_gone(job_id, on_state=on_state)
    code_file = job_dir / "exit_code"
    code = int(code_file.read_text()) if code_file.is_file() else None
    if code is None:
        said = "".join(f"\n  {line}" for line in sweep_report(job_dir))
        raise SlurmError(f"job {job_id} ended before the sweep finished{said}\nits log ends:\n{log_tail(job_dir)}")
    return code


def sweep_report(job_dir: Path) -> list[str]:
    """The lines of a one-shot job's log that say how its sweep went, in order: raybench's own (a node's step
    ended, the time limit's warning, a requeue, a stop), SLURM's cancellation (its time limit), an interruption's
    tally and the sweep's closing one."""
    logs = sorted(job_dir.glob("slurm-*.out"))
    lines = logs[-1].read_text(errors="replace").splitlines() if logs else []
    return [line.strip() for line in lines if line.startswith(("raybench: ", "interrupted ("))
            or " trial(s) run, " in line or "CANCELLED AT" in line]


def _run_command(opts: SlurmOptions, sweep: Path, store: Path, extra: list[str]) -> str:
    """The `raybench run` command line of a one-shot job, on the job's cluster. `--slurm-job`: its sweep's driver
    runs in a child, so that the stop is recorded even when Ray ends the driver first (drivers/split_run.py)."""
    cmd = shlex.join([sys.executable, "-m", "raybench", "run", str(sweep), "--store", str(store), "--slurm-job",
                      *extra])
    return f'{_container(opts)} {cmd} --address "$RAY_ADDRESS"'


def _run_payload(run: str) -> str:
    """Template payload of a one-shot job: run the sweep on the job's cluster and exit with its exit code."""
    return f'{run}\nrc=$?\necho $rc > "$RAYBENCH_JOB_DIR/exit_code"\nexit $rc\n'


# ----- warm clusters, recorded by name -----

def _record_path(name: str) -> Path:
    if not _NAME.match(name):
        raise ConfigError("cluster name", [Problem("NAME", name, "letters, digits, '_', '.', '-' (at most 64)")])
    return raybench_home() / "clusters" / f"{name}.json"


def load_record(name: str) -> dict:
    path = _record_path(name)
    if not path.is_file():
        raise SlurmError(f"no cluster named {name!r} (no {path}); start one with `raybench cluster up {name}`", 2)
    return json.loads(path.read_text())


def _save_record(record: dict) -> None:
    path = _record_path(record["name"])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)  # it holds the cluster's token: owner only, before a byte is written
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def cluster_up(name: str, opts: SlurmOptions, ready_timeout: float = 900) -> dict:
    """Submit a job that holds a Ray cluster, record it under `name`, wait until its address is known."""
    check_options(opts)
    path = _record_path(name)
    if path.is_file():
        old = json.loads(path.read_text())
        if job_state(old["job_id"]) is not None:
            raise SlurmError(f"cluster {name!r} is already up (job {old['job_id']}); "
                             f"`raybench cluster down {name}` first, or pick another name", 2)
    job_dir = _job_dir("clusters", name)
    job_id = sbatch(render(opts, job_dir, HOLD_PAYLOAD), job_dir, f"raybench-{name}")
    record = {"name": name, "job_id": job_id, "job_dir": str(job_dir), "address": None,
              "token": (job_dir / "token").read_text(), "options": asdict(opts)}
    _save_record(record)
    deadline = time.monotonic() + ready_timeout
    while (address := _address(record)) is None:
        if job_state(job_id) is None:
            tail = log_tail(job_dir)
            taken = [line for line in tail.splitlines() if line.startswith(nodes.PORT_IN_USE.split(" {")[0])]
            if taken:  # bad input: nothing of the cluster is left running
                raise SlurmError(f"cluster {name!r} (job {job_id}) did not start: {taken[0]}", 2)
            raise SlurmError(f"cluster {name!r} (job {job_id}) ended before Ray came up; its log ends:\n{tail}")
        if time.monotonic() > deadline:
            raise SlurmError(f"cluster {name!r} (job {job_id}) is not up after {ready_timeout:.0f} s (still "
                             f"{job_state(job_id)}); see `raybench cluster status {name}`")
        time.sleep(1)
    record["address"] = address
    _save_record(record)
    return record


def _address(record: dict) -> str | None:
    path = Path(record["job_dir"]) / "address"
    return path.read_text().strip() if path.is_file() else None


def cluster_status(name: str, with_nodes: bool = True) -> dict:
    """The cluster's job state and address; with `with_nodes`, its Ray nodes as Ray sees them (a node lost
    mid-sweep is listed dead with Ray's reason: SLURM may still count it as allocated). Asking Ray imports it:
    run in a process that has not imported Ray yet (the CLI). A cluster whose allocation is over or ending is
    GONE, with how it ended (`ended`: TIMEOUT, CANCELLED, COMPLETING, …)."""
    record = load_record(name)
    state, _, reason = _squeue_state(record["job_id"], "%T %r").partition(" ")  # one query for both
    ended = _ended(state, reason)
    state = "GONE" if ended else state
    status = {"name": name, "job_id": record["job_id"], "state": state, "ended": ended,
              "address": None if ended else _address(record), "job_dir": record["job_dir"], "nodes": None}
    if with_nodes and state == "RUNNING" and status["address"]:
        try:
            status["nodes"] = nodes.cluster_nodes(connect(name))
        except Exception as err:  # a head that does not answer is a finding to show, not a crash
            status["nodes_error"] = f"{type(err).__name__}: {err}"
    return status


def cluster_down(name: str, timeout: float = 300) -> str:
    """scancel the cluster's job and wait until SLURM has ended every process of it; forget the name."""
    record = load_record(name)
    job_id = record["job_id"]
    if job_state(job_id) is not None:
        slurm_command("scancel", job_id)
        if not wait_gone(job_id, timeout):
            raise SlurmError(f"job {job_id} of cluster {name!r} is still {job_state(job_id)} after {timeout} s")
    _record_path(name).unlink(missing_ok=True)
    return job_id


def connect(name: str) -> str:
    """Address of the named cluster, with its token put in this process's environment for Ray clients.

    Must run before `import ray`: Ray fixes its auth mode when it is first imported.
    """
    record = load_record(name)
    if job_state(record["job_id"]) is None:
        raise SlurmError(f"cluster {name!r} is not running (job {record['job_id']} has ended); "
                         f"`raybench cluster up {name}` to start it again", 2)
    address = _address(record)
    if address is None:
        raise SlurmError(f"cluster {name!r} (job {record['job_id']}) is not up yet; "
                         f"see `raybench cluster status {name}`", 2)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = record["token"]
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    return address


def say_allocation_ended(name: str, job_id: str, ended: str) -> str:
    """Tell the user that the warm cluster's allocation ended (as ended_state says) and what to do; returns the
    reason a stopped sweep records."""
    why = f"the allocation of cluster {name} ended: job {job_id} {ended}"
    print(f"raybench: {why}; the sweep stops (the trials in flight are stored as interrupted); start the "
          f"cluster again (`raybench cluster up {name}`) and run the same command to run the rest",
          file=sys.stderr, flush=True)
    return why


def watch_allocation(name: str, on_end: Callable[[str], None], poll_s: float = WATCH_POLL_S) -> threading.Thread:
    """While a sweep runs on the warm cluster `name`, ask SLURM every `poll_s` whether its allocation still runs;
    once it is over (its time limit, scancel, a failed head node), say so and call `on_end` with the reason, once.
    Without this, the sweep's driver learns of it from Ray only after a minute of reconnecting to a head that is
    gone, and dies with a traceback. A daemon thread: it ends with the process."""
    job_id = load_record(name)["job_id"]

    def watch() -> None:
        while True:
            try:
                ended = ended_state(job_id, running_only=True)
            except SlurmError:  # squeue not answering is no news of the job
                ended = None
            if ended:
                break
            time.sleep(poll_s)
        on_end(say_allocation_ended(name, job_id, ended))

    watcher = threading.Thread(target=watch, name=f"raybench-watch-{name}", daemon=True)
    watcher.start()
    return watcher
