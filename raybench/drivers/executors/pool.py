"""Warm worker pool: long-lived Ray actors that run trial after trial.

A Ray Train V2 trial starts new worker processes every time (~14 s here before the first step). A pool keeps
one actor per worker slot alive instead — interpreter, imported libraries, CUDA context — and each trial only
forms a fresh torch.distributed group among the actors it leases, runs `worker.run`, and tears the group
down. What keeps the per-trial cost at milliseconds (measured by bench/warm_vs_cold.py):
- one TCPStore per group, hosted by its rank-0 actor from start-up; each trial rendezvouses under a fresh
  key prefix (PrefixStore), so no port is opened and no rendezvous state leaks between trials;
- actors named and detached under one manager, so later sweeps on the same cluster find them warm.

Failures: a rank that raises destroys its process group, which breaks its peers' pending collectives, so
all ranks return and the group is reused. A group whose actor died, or that did not finish within the
trial's timeout (a hang), is killed and rebuilt on the next lease. Groups are also rebuilt after
`pool.recycle_after_trials` trials to bound slow memory creep, and when raybench's version changes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import ray

from raybench.drivers import nodes
from raybench.drivers.executors import RAY_WORKER_ENV
from raybench.runtime import fingerprint, limits, nccl_log
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

NAMESPACE = "raybench"
MANAGER_NAME = "raybench-pool-manager"
# After one rank fails, how long its peers get to notice (their collectives break) before the group is killed.
PEER_GRACE_S = 20
STORE_TIMEOUT_S = 300
# GPU memory a trial may leave allocated in its actors before the group is replaced: anything above it (a failed
# trial's engine kept alive by library globals, say) would count in the next trial's peak memory.
LEFTOVER_LIMIT_GIB = 0.25


def _code_version() -> str:
    """Pool actors run the code they imported at start-up; a group from other code is not reused."""
    return f"{fingerprint.package_version('raybench')}+{fingerprint.git_sha()}"


def _destroy_world_group() -> None:
    """Destroy the trial's default process group. DeepSpeed keeps its own references to the world group and
    reuses them on its next initialize (ZeRO-3 then fails on the destroyed group): when its comm layer wraps
    this group, destroy through it, which releases those references too."""
    import torch.distributed as dist

    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


class PoolWorker:
    """One worker slot. Rank-0 actors host the group's TCPStore; the others connect to it."""

    def __init__(self, store_host: str | None = None, store_port: int | None = None):
        import torch.distributed as dist

        # peft up front too (the worker imports it on a LoRA trial's first use): what a first import inside an
        # earlier trial leaves resident would count as held, and a later LoRA row would read 0.08 GiB low.
        import peft  # noqa: F401

        from raybench.runtime import worker  # noqa: F401  (imports torch and transformers once, up front)

        os.environ["LOCAL_RANK"] = "0"  # Ray gives each GPU actor exactly one visible device
        self.trials_run = 0  # trials this process ran: the row's process_trial_index (0 = a fresh process)
        self.changed: list[str] = []  # process-wide state the last trial changed
        if store_host is None:
            host = ray.util.get_node_ip_address()
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=STORE_TIMEOUT_S))
            self.address = (host, self.store.port)
        else:
            self.store = dist.TCPStore(store_host, store_port, is_master=False,
                                       timeout=timedelta(seconds=STORE_TIMEOUT_S))
            self.address = (store_host, store_port)

    def store_address(self) -> tuple[str, int]:
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def after_trial(self) -> dict:
        """What the last trial left in this process: GPU memory still allocated (0 on CPU), and the process-wide
        state it changed (restored already, but the group is replaced: see raybench/runtime/isolation.py)."""
        import torch

        leftover = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        return {"leftover_gib": leftover, "changed": self.changed}

    def run(self, payload: TrialPayload, trial_key: str, rank: int, world_size: int) -> RankResult | None:
        import torch
        import torch.distributed as dist

        from raybench.runtime import isolation, rank_memory, warm_up, worker  # torch: imported in the actors only

        # The actor's first trial reads the memory baseline of its later ones (held_from_earlier_trials_gib)
        # before it imports anything: what later trials' imports add (inductor for a compiled trial) is then
        # held from earlier trials and netted out, as worker.run alone would have it.
        rank_memory.held_from_earlier_trials_gib()
        # The trial's imports come before the snapshot, as in a fresh process, which has them before it trains:
        # what importing changes (DeepSpeed sets environment variables, dynamo wraps torch.manual_seed) is then
        # not this trial's change, which would replace the group after an actor's first trial of each kind. What
        # the trial patches in the modules it imports here, the snapshot sees; modules it imports later are
        # recorded as their import finishes (isolation.snapshot).
        warm_up.prepare_process(payload.config)
        before = isolation.snapshot()
        # Read when compiling, not at start: this trial's alone (put back after it), not part of the group's shape.
        cache_env = payload.compile_cache_env()
        os.environ.update(cache_env)
        # Compiled code of earlier trials must not serve this one: it compiles as a fresh process would (its
        # kernels may still come from the shared on-disk cache, as a fresh process's do).
        torch.compiler.reset()
        resources = payload.config.resources
        saved_rlimit = resource.getrlimit(resource.RLIMIT_DATA)
        backend = "nccl" if resources.gpus_per_worker > 0 else "gloo"
        if backend == "nccl":
            nccl_log.capture()  # this trial's communicators' transport choices, for its row
        dist.init_process_group(backend, store=dist.PrefixStore(trial_key, self.store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=resources.timeout_s))
        self.trials_run += 1
        try:
            # Only warm actors live past one trial: they alone keep weights in memory for the next one.
            return worker.run(payload.replace(weights_cache_gib=payload.pool.weights_cache_gib,
                                              process_trial_index=self.trials_run - 1))
        finally:
            # Leave nothing behind for the next trial: the group, compiled code, the memory cap, patched
            # globals, freed memory.
            _destroy_world_group()
            torch.compiler.reset()
            resource.setrlimit(resource.RLIMIT_DATA, saved_rlimit)
            self.changed = isolation.restore(before, set_for_trial=cache_env)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            limits.release_free_heap()


@dataclass
class Group:
    shape: tuple
    actors: list
    placement_group: object
    busy: bool = True
    trials_run: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


class PoolManager:
    """Leases groups of warm actors to trial drivers (an async actor: waiting leases do not block it)."""

    def __init__(self):
        self.groups: dict[str, Group] = {}
        self.pending: dict[str, object] = {}  # lease -> the placement group its new group waits on
        self.cancelled: set[str] = set()  # leases whose drivers gave up
        self.leased: dict[str, str] = {}  # lease -> the group it was granted, until released
        self.changed = asyncio.Condition()

    async def acquire(self, shape: tuple, lease: str) -> tuple[str, list]:
        """A free group of `shape`, else a new one (its placement group may wait for resources). `lease` names the
        request so that its driver can give it up (`cancel`) while it waits."""
        async with self.changed:
            while True:
                free = [g for g in self.groups.values() if g.shape == shape and not g.busy]
                if free:
                    free[0].busy = True
                    self.leased[lease] = free[0].id
                    return free[0].id, free[0].actors
                # Idle groups of another shape (or older code) hold resources this lease may need.
                for g in [g for g in self.groups.values() if not g.busy]:
                    self._destroy(g)
                break
        try:
            group = await self._create(shape, lease)
        except BaseException:
            self.cancelled.discard(lease)
            raise
        async with self.changed:
            self.groups[group.id] = group
            if lease in self.cancelled:  # its driver gave up while the group was being made: nobody will use it
                self.cancelled.discard(lease)
                self._destroy(group)
                raise TimeoutError(f"pool lease {lease} was cancelled while its group started")
            self.leased[lease] = group.id
        return group.id, group.actors

    def cancel(self, lease: str) -> None:
        """Give up a lease whose driver stopped waiting (timeout, not enough nodes): a group granted after that
        is destroyed (nobody will use it), and a placement group still waiting for resources is removed so that
        it cannot take them once they free up."""
        granted = self.leased.pop(lease, None)
        if granted is not None:
            if granted in self.groups:
                self._destroy(self.groups[granted])
            return
        self.cancelled.add(lease)
        pending = self.pending.pop(lease, None)
        if pending is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pending)

    async def release(self, group_id: str, healthy: bool, recycle_after_trials: int) -> None:
        async with self.changed:
            group = self.groups.get(group_id)
            if group is None:
                return
            self.leased = {lease: granted for lease, granted in self.leased.items() if granted != group_id}
            group.trials_run += 1
            if healthy and group.trials_run < recycle_after_trials:
                group.busy = False
            else:
                self._destroy(group)
            self.changed.notify_all()

    async def drain_idle(self) -> int:
        """Destroy every idle group, handing its resources back to the cluster; returns how many."""
        async with self.changed:
            idle = [g for g in self.groups.values() if not g.busy]
            for group in idle:
                self._destroy(group)
            return len(idle)

    def groups_info(self) -> list[dict]:
        """The current groups (for `raybench cluster status` and tests)."""
        return [{"id": g.id, "shape": g.shape, "busy": g.busy, "trials_run": g.trials_run, "actors": g.actors}
                for g in self.groups.values()]

    async def _create(self, shape: tuple, lease: str) -> Group:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        workers, cpus, gpus, _, env = shape
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([bundle] * workers, strategy="PACK")  # ranks of a group share nodes when they fit
        self.pending[lease] = pg
        try:
            await pg.ready()
        finally:
            self.pending.pop(lease, None)
        actor_cls = ray.remote(PoolWorker)

        def start(index: int, *store):
            return actor_cls.options(
                num_cpus=cpus, num_gpus=gpus, lifetime="detached", max_restarts=0, max_concurrency=2,
                runtime_env={"env_vars": {**dict(env), **RAY_WORKER_ENV}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            ).remote(*store)

        first = start(0)
        host, port = await first.store_address.remote()
        actors = [first] + [start(i, host, port) for i in range(1, workers)]
        await asyncio.gather(*(a.store_address.remote() for a in actors[1:]))
        return Group(shape, actors, pg)

    def _destroy(self, group: Group) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in group.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group.placement_group)
        self.groups.pop(group.id, None)


def manager():
    """The cluster's pool manager, created on first use (detached: it outlives this sweep's driver).

    DEFAULT scheduling: a Tune trial captures the actors its driver creates into the trial's placement group,
    which would take the pool down with every trial.
    """
    return ray.remote(PoolManager).options(
        name=MANAGER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_concurrency=1000, scheduling_strategy="DEFAULT",
    ).remote()


def release_idle() -> int:
    """Give idle pool actors' resources back, if this cluster has a pool: a sweep that runs its trials any
    other way would otherwise wait for CPUs/GPUs held by warm actors nobody is using."""
    try:
        pool = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
    except ValueError:
        return 0
    return ray.get(pool.drain_idle.remote())


def execute(payload: TrialPayload) -> RankResult:
    res = payload.config.resources
    deadline = time.monotonic() + res.timeout_s  # start-up included, as for every executor
    # Variables read at process start (NCCL_*, OMP_*, TORCHINDUCTOR_*, DS_ACCELERATOR, ...) take effect only
    # when the actors start with them: each distinct environment gets its own group.
    env = tuple(sorted(payload.start_env().items()))
    shape = (res.workers, res.cpus_per_worker, res.gpus_per_worker, _code_version(), env)
    pool = manager()
    group_id, actors = _lease(pool, shape, payload, deadline)
    healthy = False
    try:
        results, trial_error = _run_group(actors, payload, max(0.0, deadline - time.monotonic()))
        states = ray.get([a.after_trial.remote() for a in actors])
        healthy = (max(s["leftover_gib"] for s in states) <= LEFTOVER_LIMIT_GIB
                   and not any(s["changed"] for s in states))
    finally:
        ray.get(pool.release.remote(group_id, healthy, payload.pool.recycle_after_trials))
    if trial_error is not None:
        raise trial_error
    return results[0]


def _lease(pool, shape: tuple, payload: TrialPayload, deadline: float) -> tuple[str, list]:
    """A group of warm actors for the trial. A trial that needs more nodes than are alive ends at once (a node was
    lost), and so does one whose nodes go while its group waits for resources; a lease still waiting at the
    trial's deadline is given up. Either way the manager removes the waiting placement group."""
    res = payload.config.resources
    alive_at_start = nodes.check_fits(res.workers, res.cpus_per_worker, res.gpus_per_worker)
    lease = uuid.uuid4().hex
    ref = pool.acquire.remote(shape, lease)
    try:
        while not ray.wait([ref], timeout=min(max(0.0, deadline - time.monotonic()), nodes.NODE_CHECK_S))[0]:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"trial exceeded resources.timeout_s={res.timeout_s:g} s while its pool group "
                                   "waited for resources")
            nodes.check_fits(res.workers, res.cpus_per_worker, res.gpus_per_worker, alive_at_start)
    except BaseException:
        pool.cancel.remote(lease)
        raise
    return ray.get(ref)


def _run_group(actors: list, payload: TrialPayload, timeout_s: float) -> tuple[list, BaseException | None]:
    """Run the trial on every actor: (per-rank results, the trial's error if a rank raised).

    Raises instead when the group cannot be reused: an actor died, or ranks were still running at the
    deadline (a hang, or peers that never noticed a failed rank).
    """
    key = f"trial-{payload.trial_id}-{uuid.uuid4().hex}"
    refs = [a.run.remote(payload, key, rank, len(actors)) for rank, a in enumerate(actors)]
    deadline = time.monotonic() + timeout_s
    pending, first_error = list(refs), None
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            if first_error is not None:
                raise first_error
            raise TimeoutError(f"trial exceeded resources.timeout_s={timeout_s:g} s; its pool group was killed")
        try:
            ray.get(ready[0])
        except ray.exceptions.RayTaskError as err:  # a rank raised; RayActorError (a dead actor) propagates
            if first_error is None:
                first_error = err.as_instanceof_cause()
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
    if first_error is not None:
        return [], first_error
    return ray.get(refs), None
