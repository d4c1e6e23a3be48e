"""`raybench rehearse --jobs N`: a sweep's rehearsals on N worker processes, one group of configurations that
share traces (trials.trace_groups) at a time each, every worker with its own trace cache; the rows in plan order,
each stored by its worker as it finishes, equal to one process's (the seconds spent tracing apart)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait

from raybench.rehearse.trials import rehearse_trials, trace_groups

GROUP_DONE = "group done"  # what a worker sends after a group's last row


def default_jobs() -> int:
    """The CPUs this process may use (its affinity: a SLURM job's or a container's share, not the machine's)."""
    return len(os.sched_getaffinity(0))


class WorkersLost(Exception):
    """Worker processes died (killed: by the kernel out of memory, by a signal) before rehearsing these trials;
    what the workers finished is stored."""

    def __init__(self, exit_codes: list[int], not_rehearsed: list, store_path: str):
        self.not_rehearsed = not_rehearsed
        codes = ", ".join(f"{count} {reason}" for reason, count in Counter(map(_exit_reason, exit_codes)).items())
        named = "; ".join(f"{t.index} ({t.trial_id}: {_point(t)})" for t in not_rehearsed)
        super().__init__(
            f"{len(exit_codes)} rehearsal worker process(es) died ({codes}); {len(not_rehearsed)} configuration(s) "
            f"not rehearsed, by plan index: {named}. What finished is stored in {store_path}/rehearsals. Rehearse "
            "them again with `--trial INDEX`, or the sweep with `--jobs 1` (one process, the least memory).")


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}" + (" (e.g. out of memory)" if code == -9 else "")
    return f"exited with code {code} (its traceback is above)"


def _point(trial) -> str:
    return ", ".join(f"{name}={value}" for name, value in trial.axis_values.items()) or "the sweep's one point"


def rehearse_sweep(spec, trials: list, store_path: str, gpu: str | None = None, busbw: float | None = None,
                   full_depth: bool = False, jobs: int = 1) -> Iterator[dict]:
    """rehearse_trials's rows in plan order, on `jobs` worker processes where the sweep has more than one group
    of configurations sharing traces (in this process with `jobs` 1 or a single group). Raises WorkersLost, after
    every row that came back, if a worker died."""
    first_repeats: dict[str, object] = {}
    for t in trials:  # repeats of one configuration rehearse once
        first_repeats.setdefault(t.config_id, t)
    unique = list(first_repeats.values())
    groups = trace_groups(unique, gpu or spec.estimate.gpu)
    if jobs == 1 or len(groups) == 1:
        try:
            yield from _young_collections(rehearse_trials(spec, unique, store_path, gpu, busbw, full_depth))
        finally:
            gc.unfreeze()
        return
    yield from _in_plan_order(unique, _rows_from_workers(spec, groups, store_path, (gpu, busbw, full_depth), jobs))


def _young_collections(rows: Iterator[dict]) -> Iterator[dict]:
    """`rows`, with the garbage of each configuration collected after it, and what outlives it frozen (the
    permanent generation). Python's full collections scan every object alive, and a sweep's trace cache holds
    millions: they took 7-15% of a rehearsal, more the longer a process ran. Frozen, later collections scan only
    what the next configurations make."""
    for row in rows:
        yield row
        gc.collect()
        gc.freeze()


def _in_plan_order(trials: list, rows: Iterator[dict]) -> Iterator[dict]:
    """`rows` (any order) in the order of `trials`, each as soon as those before it are out (the text and JSON
    output are the same whatever finished first); on WorkersLost, the rows that came back, then the error."""
    order = [t.config_id for t in trials]
    waiting: dict[str, dict] = {}
    done = 0
    try:
        for row in rows:
            waiting[row["config_id"]] = row
            while done < len(order) and order[done] in waiting:
                yield waiting.pop(order[done])
                done += 1
    except WorkersLost:
        yield from (waiting[c] for c in order if c in waiting)
        raise


def _cost(group: list) -> int:
    """A group's rough tracing cost, for handing out the costly groups first: decoder blocks x micro-batches
    traced (up to three kinds a step), over its configurations."""
    return sum(t.shape.num_hidden_layers * min(t.config.train.grad_accum, 3) for t in group)


def _rows_from_workers(spec, groups: list, store_path: str, options: tuple, jobs: int) -> Iterator[dict]:
    """Each row as a worker sends it. Groups go out costliest first, the next to whichever worker is free; a
    worker that dies loses the rest of its group, the others go on; WorkersLost at the end names what was lost.
    Leaving early (Ctrl-C, the caller stopping) terminates the workers."""
    context = multiprocessing.get_context("spawn")  # not fork: torch's threads and state do not survive a fork
    pending = sorted(groups, key=_cost, reverse=True)
    threads = max(1, default_jobs() // jobs)
    workers: dict[Connection, tuple] = {}  # the parent's end of each worker's pipe: (process, its group's rest)
    lost, exit_codes = [], []
    # Started here, not by the first worker's start: starting it unblocks SIGINT (it blocks and unblocks it around
    # its own start), which would let a worker start without Ctrl-C held (_ctrl_c_held).
    resource_tracker.ensure_running()
    try:
        for _ in range(min(jobs, len(groups))):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker, args=(theirs, spec, store_path, options, threads), daemon=True)
            with _ctrl_c_held():  # a Ctrl-C meanwhile is raised here once the worker is started and known
                process.start()
                workers[ours] = (process, {})
            theirs.close()  # so that the worker's death reads as the end of its pipe here
            _hand_out(ours, workers, pending)
        while workers:
            for conn in wait(list(workers)):
                process, rest = workers[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the worker died
                    process.join()
                    exit_codes.append(process.exitcode)
                    lost += rest.values()
                    del workers[conn]
                    continue
                if message == GROUP_DONE:
                    _hand_out(conn, workers, pending)
                else:
                    rest.pop(message["config_id"])
                    yield message
        lost += [t for group in pending for t in group]  # every worker died before these were handed out
        if lost:
            raise WorkersLost(exit_codes, sorted(lost, key=lambda t: t.index), store_path)
    finally:
        for conn, (process, _) in workers.items():
            process.terminate()
            process.join()
            conn.close()


@contextmanager
def _ctrl_c_held():
    """SIGINT held back meanwhile, then delivered to this process's own handler. Blocked, not ignored: a worker
    started meanwhile inherits the block through exec, so a Ctrl-C cannot interrupt its start-up, and it ignores
    SIGINT from its first line (_worker); ignoring it here instead would drop a Ctrl-C that came meanwhile."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    caught = []
    # Recorded, not raised: another thread of this process may take the signal while this one blocks it.
    handler = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # runs the recorder if one is pending
        signal.signal(signal.SIGINT, handler)
    if caught:
        signal.raise_signal(signal.SIGINT)  # to the handler this process had: KeyboardInterrupt by default


def _hand_out(conn: Connection, workers: dict, pending: list) -> None:
    """The next group to the worker at `conn`, or its stop (None) and its end when none is left."""
    process, rest = workers[conn]
    group = pending.pop(0) if pending else None
    try:
        conn.send(group)
    except OSError:  # it died since its last message: the next wait reads its end, and loses the group
        pass
    rest.update({t.config_id: t for t in group or ()})
    if group is None:
        process.join()
        conn.close()
        del workers[conn]


def _worker(conn: Connection, spec, store_path: str, options: tuple, threads: int) -> None:
    """A worker process: rehearse each group it is sent (rows back as they finish) until it is sent None."""
    import torch

    # Ctrl-C reaches every process of the terminal's group: the parent stops the workers, they need not. Blocked
    # since the start (_ctrl_c_held); ignored from here, which drops one that came meanwhile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(threads)  # one CPU's share each: the trace is Python, torch's thread pool oversubscribes
    traces: dict = {}  # one cache for every group this worker rehearses, as one process keeps for a sweep
    gpu, busbw, full_depth = options
    try:
        while (group := conn.recv()) is not None:
            # Frozen for the worker's life: its trace cache lives as long.
            for row in _young_collections(rehearse_trials(spec, group, store_path, gpu, busbw, full_depth, traces)):
                conn.send(row)
            conn.send(GROUP_DONE)
    except (EOFError, BrokenPipeError):  # the parent is gone (killed): nothing is left to send rows to
        return
