"""`raybench rehearse --jobs N` gives each worker process whole groups of configurations that share traces
(trials.trace_groups): no trace is made in two groups, a group rehearsed on its own gives what the sweep in one
process gives, --jobs must be a whole number of at least 1, and a Ctrl-C while a worker starts is held, not lost.
The worker processes themselves run in tests/integration/test_rehearse_jobs.py."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.rehearse import step_time, workers
from raybench.rehearse.trace import StepTrace
from raybench.rehearse.trials import rehearse_trials, trace_groups
from raybench.rehearse.workers import WorkersLost
from raybench.spec.load import load_sweep, parse_sweep
from conftest import make_model_dir

GPU = "H100 SXM"
REPO = Path(__file__).resolve().parents[2]


def sweep(model: dict, axes: dict):
    return parse_sweep({"name": "groups", "model": model,
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 64, "micro_batch": 1, "precision": "bf16",
                                  "strategy": "fsdp2"},
                        "resources": {"workers": 2, "gpus_per_worker": 1}, "estimate": {"gpu": GPU}, "axes": axes})


def test_a_sweep_s_groups_follow_what_its_rehearsals_share():
    """The 1,050-point grid: a model's FSDP2 points are one group (one block's operators for the op-level
    policy are shared by every world size and accumulation count, and so are its steps once two world sizes are
    traced), TP's split by accumulation count (every world size sharing its steps, every sAC ratio its shallow
    models), DDP's by accumulation count (its step is traced once for every world). Seed 001: compiled twins and
    every sAC ratio with their model."""
    grid = plan(load_sweep(REPO / "bench" / "sweeps" / "grid-1000.yaml"))
    groups = trace_groups(grid, GPU)
    assert sorted(t.index for g in groups for t in g) == [t.index for t in grid]
    kinds = Counter((g[0].axis_values["train.strategy"], len(g)) for g in groups)
    assert kinds == {("fsdp2", 50): 10, ("tp_fsdp2", 25): 20, ("ddp", 25): 2}
    for group in groups:
        assert len({(t.axis_values["model.preset"], t.axis_values["train.strategy"]) for t in group}) == 1
        assert [t.index for t in group] == sorted(t.index for t in group)  # each in plan order
    seed001 = plan(load_sweep(REPO / "sweeps" / "seed001-idris-sac.yaml"))
    assert [{t.axis_values["model.preset"] for t in g} for g in trace_groups(seed001, GPU)] == [
        {"qwen2.5-14b"}, {"qwen2.5-32b"}, {"qwen2.5-72b"}]


class UseLog(dict):
    """A trace cache (a plain dict) that notes which configurations read or write each of its keys."""

    def __init__(self):
        super().__init__()
        self.config_id = None  # the configuration being rehearsed
        self.users: dict = {}

    def _used(self, key):
        self.users.setdefault(key, set()).add(self.config_id)

    def __contains__(self, key):
        self._used(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._used(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self._used(key)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        self._used(key)
        return super().setdefault(key, default)


def test_no_trace_is_shared_between_two_groups(tmp_path):
    """An 8-block model (its depth extrapolated from shallow models that sAC 5/8 and 3/4 share: both checkpoint
    every block but the second and a middle one, CC.C in their ends) under FSDP2 at two world sizes (each traces
    its own shallow models, kept as the ends of the line a third world size would be shared from: one group) and
    DDP (one step for both): the sweep rehearsed through one cache,
    as one process does, uses every cached trace from within one group only, so a worker rehearsing a group with
    a cache of its own makes each trace once and finds what one process finds."""
    model = make_model_dir(tmp_path / "deep", layers=8)
    spec = sweep({"path": str(model)}, {"model_sharding": [{"train.strategy": "fsdp2", "train.ac_ratio": "5/8"},
                                                           {"train.strategy": "fsdp2", "train.ac_ratio": "3/4"},
                                                           {"train.strategy": "ddp", "train.ac_ratio": "0"}],
                                        "resources.workers": [2, 4]})
    trials = plan(spec)
    groups = trace_groups(trials, GPU)
    assert [[t.axis_values["resources.workers"] for t in g] for g in groups] == [[2, 4, 2, 4], [2, 4]]
    group_of = {t.config_id: number for number, group in enumerate(groups) for t in group}
    cache = UseLog()
    for t in trials:
        cache.config_id = t.config_id
        (row,) = rehearse_trials(spec, [t], str(tmp_path / "store"), traces=cache)
        assert row["method"] == "traced"
    assert any("extrapolated to 8 blocks" in note for note in row["notes"])
    shared = {key: users for key, users in cache.users.items() if len(users) > 1}
    assert sum(key[0] == "shallow" for key in shared) == 2 * 4  # the ratios' shallow models, per world size
    assert sum(key[0] == "world ends" for key in shared) == 4  # each shallow model's world sizes (worlds.py)
    assert sum(key[0] == "world ends split from" for key in shared) == 4  # and which of them one trace gave
    # The shallow models and their world notes, their ends and which were split, and DDP's step and note.
    assert len(shared) == 2 * 4 * 2 + 4 + 4 + 2
    assert all(len({group_of[c] for c in users}) == 1 for users in cache.users.values()), shared


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_jobs_below_one_is_bad_input_naming_the_value_and_the_fix(bad, tmp_path, capsys):
    store = tmp_path / "store"
    assert cli.main(["rehearse", str(REPO / "sweeps" / "seed001-idris-sac.yaml"), "--store", str(store),
                     "--jobs", bad]) == 2
    err = capsys.readouterr().err
    assert f"raybench rehearse: 1 problem(s); nothing was launched or written\n  - --jobs = {bad}: the number of " \
           "worker processes must be at least 1 (1: rehearse in this process; leave --jobs out for one per CPU " \
           "this process may use)" in err
    assert not store.exists()


def test_the_lost_trials_are_named_with_why_and_what_to_do():
    trials = plan(sweep({"preset": "tiny"}, {"resources.workers": [2, 4, 8]}))
    err = WorkersLost([-9, 1, -9], trials[1:], "STORE")
    assert str(err) == (
        "3 rehearsal worker process(es) died (2 killed by signal SIGKILL (e.g. out of memory), 1 exited with code 1 "
        f"(its traceback is above)); 2 configuration(s) not rehearsed, by plan index: 1 ({trials[1].trial_id}: "
        f"resources.workers=4); 2 ({trials[2].trial_id}: resources.workers=8). What finished is stored in "
        "STORE/rehearsals. Rehearse them again with `--trial INDEX`, or the sweep with `--jobs 1` (one process, "
        "the least memory).")


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_step_prices_the_same_whatever_order_its_collectives_come_in(order):
    """A worker process must price a trace as the command's own process does, to the last bit; the order of a
    trace's collectives can follow a set's (depth.py combines shallow traces' tables over their keys' union),
    which Python's per-process hash seed varies. Seed 001's Qwen2.5-72B point on 64 ranks, 4 GPUs a node."""
    collectives = [("all_reduce", 3852, 1), ("allgather_base", 290824814592, 162),
                   ("reduce_scatter_base", 290824814592, 81)]
    ordered = [collectives[i] for i in order]
    trace = StepTrace(memory_gib={}, resident_gib={}, comm_bytes={name: n for name, n, _ in ordered},
                      comm_calls={name: calls for name, _, calls in ordered}, overlapped_comm=(), flops=1e15,
                      roofline_s=1.0, compute_s=1.0, memory_s=0.0)
    priced = step_time.predict_step_time(trace, 64, 200.0, "set", layout=step_time.Layout(4, 4))
    assert (priced.comm_s, priced.comm_latency_s) == (2.9556800151617386, 0.0928732)  # summed by name


def test_rows_come_out_in_plan_order_whatever_finished_first_and_before_a_lost_worker_s_error():
    trials = plan(sweep({"preset": "tiny"}, {"resources.workers": [2, 4, 8, 16]}))
    first, second, third, fourth = ({"config_id": t.config_id, "index": t.index} for t in trials)

    def finished(rows, lost=None):
        yield from rows
        if lost:
            raise WorkersLost([-9], lost, "STORE")

    assert list(workers._in_plan_order(trials, finished([third, first, fourth, second]))) == [
        first, second, third, fourth]
    out = []
    with pytest.raises(WorkersLost):  # the second's worker died: the rows that came back, in plan order, first
        for row in workers._in_plan_order(trials, finished([fourth, first, third], lost=[trials[1]])):
            out.append(row)
    assert out == [first, third, fourth]


def test_a_ctrl_c_while_a_worker_starts_is_raised_once_it_has_started_and_the_worker_starts_with_it_blocked(
        sigint_as_in_a_terminal):
    before = signal.getsignal(signal.SIGINT)
    started = None
    with pytest.raises(KeyboardInterrupt):
        with workers._ctrl_c_held():
            # To the main thread: a thread of this test process (Ray's, the test runner's) may take one sent to the
            # process and not pass it on; the CLI's process has none such.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            started = subprocess.run(  # as a worker's start-up: its mask is inherited through exec
                [sys.executable, "-c", "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"],
                capture_output=True, text=True, check=True).stdout.strip()
    assert started == "True"
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
