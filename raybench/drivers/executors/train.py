"""Ray Train V2: one TorchTrainer per trial, run from inside the trial's Ray Tune driver.

Workers report nothing during the loop (a Train V2 report costs ~1.6 s); rank 0's return value, its `RankResult`,
comes back through `Result.return_value`.

`fit()` runs in a Ray task of its own (zero CPUs) so that a trial past `resources.timeout_s` can be ended with
public APIs only: force-cancelling the task kills its worker process; the Train controller actor it created
dies with its owner, and the training workers die with the controller. Placement groups a dead controller
still held are released by the sweep driver (`orphan_reaper`).
"""

from __future__ import annotations

import functools
import logging
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from raybench.drivers import nodes
from raybench.drivers.executors import RAY_WORKER_ENV
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

# Seconds to wait for the cancelled fit task to be reported dead before giving up on it.
CANCEL_WAIT_S = 30
# How often a running or waiting trial checks that it still fits on the cluster's alive nodes (a node lost).
# How often the sweep driver looks for placement groups that dead Train controllers left reserved.
REAP_INTERVAL_S = 2.0
# Ray Train settings for every trial's controller, against what its defaults cost a short trial
# (docs/results/train-timeline-2026-11-25.md):
# - the controller learns that training ended at its next poll of the workers: every 2 s by default, 1 s lost on
#   average. A poll still pending is awaited at the next one, not failed (a worker counts as dead only after
#   10 minutes without an answer), so polling more often puts no busy worker at risk;
# - the preemption watcher, one more process per trial, only logs node drains: a raybench trial is never
#   retried, so a drain's notice would change nothing.
TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

log = logging.getLogger(__name__)


def rank_loop(payload: TrialPayload) -> Callable[[], RankResult | None]:
    """What each Ray Train worker runs: the trial's ranks get the payload object itself (Ray pickles the loop once
    for all workers, and unpickling is no validation; a train_loop_config would also be copied into JSON text for
    Train's state export)."""
    return functools.partial(_train_loop, payload)


def _train_loop(payload: TrialPayload) -> RankResult | None:
    from raybench.runtime import worker  # torch: loaded in the training workers only

    return worker.run(payload)


def _fit(payload: TrialPayload) -> RankResult:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = payload.config.resources
    use_gpu = resources.gpus_per_worker > 0
    trainer = TorchTrainer(
        rank_loop(payload),
        scaling_config=ScalingConfig(
            num_workers=resources.workers,
            use_gpu=use_gpu,
            resources_per_worker=worker_resources(payload),
        ),
        # Collectives stuck past the trial's budget fail inside the workers as well.
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(resources.timeout_s)),
        run_config=RunConfig(
            name=f"{payload.trial_id}-{uuid.uuid4().hex[:8]}",
            storage_path=str(Path(tempfile.gettempdir()) / "raybench-train"),
            # No retries: a worker that dies, in training or while starting (which Train V2 would otherwise
            # retry forever), fails the trial; the row says why.
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
            # train.env reaches this trial's worker processes only, before their process group exists.
            worker_runtime_env={"env_vars": {**payload.worker_env(), **RAY_WORKER_ENV}},
        ),
    )
    # fit() on a main thread (a Ray task's is one) installs a SIGINT handler holding its Train controller's
    # handle, which kept the controller actor alive after the trial, one per trial; restore the handler.
    previous = signal.getsignal(signal.SIGINT)
    try:
        result = trainer.fit()
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    if result.error is not None:
        raise result.error
    if not isinstance(result.return_value, RankResult):
        raise RuntimeError("rank 0 returned no result")
    return result.return_value


def worker_resources(payload: TrialPayload) -> dict[str, float]:
    """What each Ray Train worker of the trial reserves on its node."""
    resources = payload.config.resources
    return {"CPU": resources.cpus_per_worker, **({"GPU": 1} if resources.gpus_per_worker > 0 else {})}


def _check_fits(payload: TrialPayload, alive_at_start: set[str] | None = None) -> set[str]:
    """nodes.check_fits for this trial's workers: raises NodeLost / NotEnoughNodes, else the alive node ids."""
    per_worker = worker_resources(payload)
    return nodes.check_fits(payload.config.resources.workers, per_worker["CPU"], per_worker.get("GPU", 0),
                            alive_at_start)


def execute(payload: TrialPayload) -> RankResult:
    import ray

    timeout_s = payload.config.resources.timeout_s
    # A trial that needs more nodes than are alive ends now, not at its timeout (a node was lost).
    alive_at_start = _check_fits(payload)
    # Pinned to this node (the controller attaches to its creator's node) and never retried: a failed
    # trial is a row, not a second attempt.
    # RAY_ADDRESS names this cluster to the controller and its helpers (inherited runtime env): Train V2's
    # placement-group cleaner finds the cluster through the state API, which gives up when a second Ray
    # runs on the host ("Found multiple active Ray instances") and would leave the trial's resources held.
    # Train's own 60 s limit on waiting for workers would fail a trial that is merely queued behind one being
    # torn down; resources.timeout_s already bounds start-up.
    env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(int(timeout_s)), **TRAIN_ENV}
    fit = ray.remote(num_cpus=0, max_retries=0, runtime_env={"env_vars": env})(_fit)
    ref = fit.remote(payload)
    ready, waiting = [], ""
    deadline = time.monotonic() + timeout_s
    try:
        while not ready and (left := deadline - time.monotonic()) > 0:
            ready, _ = ray.wait([ref], timeout=min(left, nodes.NODE_CHECK_S))
            if not ready:  # a node lost while the trial runs or waits for resources ends it now
                _check_fits(payload, alive_at_start)
        if not ready:
            waiting = _waiting_for_resources()  # before the cancel frees what this trial holds
    finally:
        if not ready:  # timed out, node lost, or interrupted (Tune stopping): the trainer must not outlive it
            _cancel(ref)
    if not ready:
        raise TimeoutError(f"trial exceeded resources.timeout_s={timeout_s:g} s; its Ray Train run was "
                           f"killed{waiting}")
    try:
        return _unwrap(ref)
    except Exception as err:  # a rank on a node that died fails first: name the node in the row
        failure = f"{type(err).__name__}: {err}"
        if gone := nodes.lost_during(failure, alive_at_start):
            raise nodes.NodeLost(nodes.lost_message(gone, failure)) from err
        raise


def _waiting_for_resources() -> str:
    """Whether the cluster still had placement groups waiting for resources at a timeout (a trial queued behind
    resources something else holds, not one that hung), as a note for the row's message; "" when none."""
    import ray

    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]
    if not pending:
        return ""
    free, total = ray.available_resources(), ray.cluster_resources()
    free_of_total = ", ".join(f"{name} {free.get(name, 0):g} of {total[name]:g}"
                              for name in ("CPU", "GPU") if name in total)
    return f" while {len(pending)} placement group(s) still waited for resources (free: {free_of_total})"


def _cancel(ref) -> None:
    """Kill the fit task's process and wait until Ray reports it gone (its actors and resources go with it)."""
    import ray

    ray.cancel(ref, force=True, recursive=True)
    try:
        ray.get(ref, timeout=CANCEL_WAIT_S)
    except Exception:  # cancelled/crashed is the expected outcome; a finished result is dropped
        pass


def _unwrap(ref) -> RankResult:
    """The task's return value; a failure inside it is re-raised as its original error where Ray has it."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = err.as_instanceof_cause()
        raise cause from None


def release_orphaned_placement_groups() -> int:
    """Remove this job's placement groups whose creating actor is dead; returns how many were removed.

    Ray removes a (non-detached) placement group only once both its creator actor and its job are gone, and a
    sweep's job lives as long as its driver. So a group that a Ray Train controller still held when it ended
    stays reserved, and every later trial waits for CPUs and GPUs that nobody uses. Ray Train 2.60 leaves one
    behind (1) when a worker dies after its worker group counts as started but before the controller holds
    the group, and (2) when a trial is ended (timeout, interrupt) while its group waits for resources: the
    group is reserved once they free up (docs/reliability.md). The sweep's own groups (Tune's, the pool's)
    are created by the driver or by a live actor and are never touched.
    """
    import ray
    from ray._private.state import state  # private: the public table leaves out who created each group
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    removed = 0
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        group = PlacementGroupTableData.FromString(raw)
        orphaned = (group.creator_actor_dead and not ray.ActorID(group.creator_actor_id).is_nil()
                    and not group.is_detached and group.state != PlacementGroupTableData.REMOVED
                    and ray.JobID(group.creator_job_id).hex() == job)
        if orphaned:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(group.placement_group_id)))
            removed += 1
    return removed


def orphan_reaper():
    """A Ray Tune callback for the sweep driver: every REAP_INTERVAL_S of Tune's loop, release the placement
    groups dead Train controllers left reserved (see release_orphaned_placement_groups)."""
    from ray import tune

    class OrphanReaper(tune.Callback):
        def __init__(self):
            self.next_check = 0.0

        def on_step_begin(self, iteration, trials, **info):
            if time.monotonic() < self.next_check:
                return
            self.next_check = time.monotonic() + REAP_INTERVAL_S
            if removed := release_orphaned_placement_groups():
                log.warning("released %d placement group(s) that ended Ray Train trials had left reserved", removed)

    return OrphanReaper()
