"""A `command` (`torchtune`, `torchtitan`) stack's trial: run the command line out of process and reduce what its
probe wrote.

The command (torchrun over the user's script, torchtune, torchtitan, ...) starts its own ranks; each calls
`raybench.runtime.probe.StepProbe` and writes its record to RAYBENCH_PROBE_DIR at the end. The records go
through the same `rank_metrics.combine` and `rank_metrics.rank_result` as raybench's own loop, so the row has the
same columns.

Under `executor: train` the command runs inside a Ray task that reserves the trial's CPUs and GPUs on one node
(`execute_on_ray`); under `executor: torchrun` it runs on this machine (`execute`). The row's `executor` column
keeps the sweep's executor (resumes match stored rows by it); `stack_kind` says `command`.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import raybench
from raybench.drivers.executors import RAY_WORKER_ENV, failure
from raybench.drivers.executors.torchrun import wait_or_kill
from raybench.planning.stacks import planning_module
from raybench.runtime.probe import RECORD_DIR_ENV
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import GIB, RankResult

# The raybench package's directory: the command's PYTHONPATH exposes it (and nothing else of raybench's
# environment), so the stack's own environment imports the probe (standard library and torch only).
PACKAGE_DIR = Path(raybench.__file__).resolve().parent
OUTPUT_TAIL_LINES = 60
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Seconds the Ray task may take beyond resources.timeout_s (its own start, killing the command) before the
# trial driver cancels it.
RAY_TASK_GRACE_S = 60
# The stack environment's versions, read without importing anything heavy.
_VERSIONS_CODE = ("import importlib.metadata as m, json, platform\n"
                  "def v(n):\n"
                  "    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
                  "print(json.dumps({'python': platform.python_version(), "
                  "**{n: v(n) for n in ('torch', 'transformers', 'peft', 'deepspeed', 'torchtune', 'torchtitan')}}))")


def execute(payload: TrialPayload) -> RankResult:
    """Run the trial's command on this machine; its result as rank 0 of raybench's own workers would give it."""
    config = payload.config
    resources = config.resources
    python = config.stack.python or sys.executable
    argv = _argv(config, python)
    with tempfile.TemporaryDirectory(prefix="raybench-command-") as tmp:
        probe_dir, log_path = Path(tmp, "probe"), Path(tmp, "output.log")
        probe_dir.mkdir()
        env = _command_env(payload, probe_dir, _raybench_path(Path(tmp)))
        launched_wall, t0 = time.time(), time.perf_counter()
        # Output to a file, not a pipe: a chatty command never blocks on a full pipe. The command runs in the
        # scratch directory (paths in it are absolute, or {sweep_dir}/...: docs/stacks/command.md).
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp,
                                    env=env, start_new_session=True,
                                    preexec_fn=_child_setup(resources.memory_limit_gib))
            returncode = wait_or_kill(proc, resources.timeout_s, "its command was killed")
        wall_s = time.perf_counter() - t0
        output = log_path.read_text(errors="replace")
        if returncode != 0:
            raise RuntimeError(_failure_text(argv, returncode, output))
        records = _records(probe_dir, resources.workers, output)
    return _result(payload, records, launched_wall, wall_s, python, argv, env)


def execute_on_ray(payload: TrialPayload) -> RankResult:
    """`execute` inside a Ray task holding the trial's CPUs and GPUs on one node, never retried."""
    import ray

    resources = payload.config.resources
    task = ray.remote(num_cpus=resources.workers * resources.cpus_per_worker,
                      num_gpus=resources.workers * resources.gpus_per_worker, max_retries=0,
                      # not in the trial driver's placement group (Tune's, holding the driver only)
                      scheduling_strategy="DEFAULT", runtime_env={"env_vars": RAY_WORKER_ENV})(execute)
    ref = task.remote(payload)
    ready = []
    try:  # the task kills its command at resources.timeout_s itself; this bounds a task that never got to run it
        ready, _ = ray.wait([ref], timeout=resources.timeout_s + RAY_TASK_GRACE_S)
    finally:
        if not ready:  # the command gets SIGTERM when the task's process dies (_child_setup)
            ray.cancel(ref, force=True)
    if not ready:
        raise TimeoutError(f"trial exceeded resources.timeout_s={resources.timeout_s:g} s; its Ray task (queued "
                           "for resources or stuck) was cancelled")
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        raise err.as_instanceof_cause() from None  # a TimeoutError stays one: the row says timeout


def _raybench_path(scratch: Path) -> str:
    """A directory holding only a link to the raybench package. Not the directory raybench is installed in:
    that is raybench's site-packages, whose torch would shadow the stack's own."""
    directory = scratch / "pythonpath"
    directory.mkdir()
    (directory / "raybench").symlink_to(PACKAGE_DIR, target_is_directory=True)
    return str(directory)


def _command_env(payload: TrialPayload, probe_dir: Path, raybench_path: str) -> dict[str, str]:
    """The launcher's environment, each rank's CPU threads, the trial's worker environment, where the probe
    writes, and the raybench package first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (raybench_path, os.environ.get("PYTHONPATH")) if p)
    # Ray set the task's threads to the whole trial's CPUs, which every rank would otherwise take (train.env may
    # still set its own).
    return {**os.environ, **payload.threads_env(), **payload.worker_env(), RECORD_DIR_ENV: str(probe_dir),
            "PYTHONPATH": path}


def _child_setup(memory_limit_gib: float | None):
    """Before exec: die with the process that started the command, and cap every process's private memory
    like raybench's own workers (resources.memory_limit_gib, RLIMIT_DATA; inherited by the ranks)."""
    def setup() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if memory_limit_gib is not None:
            cap = int(memory_limit_gib * GIB)
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    return setup


def _failure_text(argv: list[str], returncode: int, output: str) -> str:
    """The command's failure: its output's tail, then, last, so that the row's message is that line and not a
    launcher's summary (torchrun ends with ChildFailedError, which only says a rank failed): the rank (or command)
    a signal killed, with the output's last error line, else the command's own last exception line."""
    tail = "\n".join(output.splitlines()[-OUTPUT_TAIL_LINES:])
    head = f"the command {_name(argv)} exited with status {returncode}; the end of its output:\n{tail}"
    killed = failure.signal_death(output, returncode, _name(argv))
    if killed:
        return f"{head}\n\n{killed}"
    errors = failure.exception_lines(output)
    return f"{head}\n\nits last error line:\n{errors[-1]}" if errors else head


def _records(probe_dir: Path, workers: int, output: str) -> list[dict]:
    """Every rank's probe record; one per rank (resources.workers) or the trial fails saying which are missing."""
    paths = sorted(probe_dir.glob("rank-*.json"))
    if len(paths) != workers:
        tail = "\n".join(output.splitlines()[-20:])
        raise RuntimeError(f"the command exited 0 but {len(paths)} rank record(s) were written for "
                           f"resources.workers={workers}: each rank must call StepProbe.start(), step() per "
                           f"optimizer step and finish() (docs/stacks/command.md); its output ended:\n{tail}")
    return [json.loads(p.read_text()) for p in paths]


def _result(payload: TrialPayload, records: list[dict], launched_wall: float, wall_s: float, python: str,
            argv: list[str], env: dict[str, str]) -> RankResult:
    import torch

    from raybench.runtime import fingerprint, provenance, rank_metrics
    from raybench.runtime.strategies import RankContext
    from raybench.spec.hardware import peak_tflops

    config = payload.config
    workers = config.resources.workers
    for record in records:  # the probe does not know when its process started: the launch is the start
        record["time_to_first_step_s"] = record["step_starts_wall"][0] + record["step_times_s"][0] - launched_wall
    reduced = rank_metrics.combine(records, tp_size=1, warmup_steps=config.train.warmup_steps)
    params_total, params_trainable, flops = _model_facts(config, records[0].get("params"))
    on_gpu = records[0].get("device_type") == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    hardware = fingerprint.hardware(device)
    facts = rank_metrics.TrialFacts(
        train=config.train, world_size=workers, dp_size=workers, params_total=params_total,
        params_trainable=params_trainable, flops_per_token=flops,
        peak_tflops=peak_tflops(hardware["gpu_name"], config.train.precision), comm_exposed_p50_s=None,
        weights_cache=None, weights_copy_s=None, worker_wall_s=wall_s, process_trial_index=0)
    ctx = RankContext(rank=0, world_size=workers, local_rank=0, device=device)
    versions = _stack_versions(python, env)
    columns = provenance.columns(config, ctx, [socket.gethostname()], {}, hardware, provenance.NOT_CHECKED_STACK,
                                 _stack_software(versions))
    return rank_metrics.rank_result(reduced, facts, columns, env=env, stack_version=_stack_version(argv, versions),
                                    data_taken=None)


def _stack_software(versions: dict) -> dict:
    """The software columns: the Python and libraries of the environment the command ran in (`_stack_versions`),
    not raybench's; raybench's own (raybench, ray, CUDA, NCCL, git sha) as this process has them."""
    from raybench.runtime import fingerprint

    stack = {f"{package}_version": versions.get(package) for package in ("torch", "transformers", "peft", "deepspeed")}
    return {**fingerprint.software(), **stack, "python_version": versions.get("python")}


def _model_facts(config, reported: dict | None) -> tuple[int, int | None, float | None]:
    """Parameters of the trained model and its FLOPs per token. Its shape is the trial's model (model.preset or
    model.path's config.json: the model the command trains, docs/stacks/command.md). Its parameter counts are the
    ones the script reported to the probe (`reported`, rank 0's record: `StepProbe.count_params`), else those its
    kind's config gives (torchtune's LoRA recipes add their adapters); a plain command's config says nothing of what
    trains, so without a report its trainable parameters, and with them its FLOPs and MFU, are null rather than a
    full fine-tune's; so are the FLOPs where the reported total is below the model section's (another model).
    FLOPs per token need the sequence length to be the trial's, a train field the kind takes
    (torchtune and torchtitan always; a command that takes {seq_len})."""
    from raybench.planning.estimate import param_counts
    from raybench.spec import metrics
    from raybench.spec.presets import model_shape

    planned = planning_module(config.stack.kind)
    shape = model_shape(config)
    counts = param_counts(shape, config.train)
    base = counts.total - counts.adapters
    if reported is not None:
        total, trainable = reported["total"], reported["trainable"]
    else:
        adapters = planned.adapter_params(config, shape)  # None: the kind's config does not say
        if adapters is None:
            total, trainable = base, None
        else:  # 0: a full fine-tune
            total, trainable = base + adapters, adapters or base
    # A report below the model section's own count is of another model: its shape would give false FLOPs.
    if trainable is None or total < base or "seq_len" not in planned.mapped(config):
        return total, trainable, None
    matmul = metrics.matmul_params(total, shape.vocab_size, shape.hidden_size, shape.tie_word_embeddings)
    flops = metrics.flops_per_token(matmul, trainable, trainable == total, shape.num_hidden_layers,
                                    config.train.seq_len, shape.hidden_size)
    return total, trainable, flops


def _argv(config, python: str) -> list[str]:
    """The trial's command, as its kind's planning module writes it: the user's own (placeholders filled),
    torchtune's launch of its recipe, or torchtitan's of its trainer."""
    return planning_module(config.stack.kind).argv(config, python)


def _stack_versions(python: str, env: dict[str, str]) -> dict:
    """The Python and library versions of the environment the command ran in ({} when they cannot be read)."""
    try:
        out = subprocess.run([python, "-c", _VERSIONS_CODE], capture_output=True, text=True, env=env, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}


def _stack_version(argv: list[str], versions: dict) -> str:
    """What ran, for the row: the command (with its module for `python -m ...`) and its environment's versions."""
    libraries = ", ".join(f"{name} {versions[name]}" for name in ("torchtune", "torchtitan", "torch")
                          if versions.get(name))
    python = f"python {versions['python']}" if versions.get("python") else ""
    return f"{_name(argv)} ({', '.join(p for p in (python, libraries) if p)})"


def _name(argv: list[str]) -> str:
    name = os.path.basename(argv[0])
    return f"{name} -m {argv[2]}" if len(argv) > 2 and argv[1] == "-m" else name
