"""`raybench rehearse --jobs 2`: two spawned worker processes store and print what one process does (in plan
order); a worker killed mid-sweep leaves what finished stored and an error naming every configuration not
rehearsed; Ctrl-C stops the workers. (Which configurations go together: tests/unit/test_rehearse_groups.py.)"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.rehearse.trials import trace_groups
from raybench.spec.load import load_sweep

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# The tiny preset under FSDP2 and DDP, no checkpointing and every block checkpointed, 2 and 4 ranks: two groups of
# four (FSDP2's world sizes share one block's operators for the op-level policy, DDP's their step).
SWEEP = {"name": "jobs", "model": {"preset": "tiny"},
         "train": {"steps": 2, "warmup_steps": 1, "seq_len": 128, "micro_batch": 2, "precision": "bf16"},
         "resources": {"workers": 2, "gpus_per_worker": 1}, "estimate": {"gpu": "H100 SXM"},
         "axes": {"train.strategy": ["fsdp2", "ddp"], "train.ac_ratio": ["0", "1"], "resources.workers": [2, 4]}}


@pytest.fixture
def sweep(tmp_path) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    assert [len(g) for g in trace_groups(plan(load_sweep(path)), "H100 SXM")] == [4, 4]
    return path


def rehearse(sweep: Path, store: Path, jobs: int, capsys) -> tuple[int, list[dict], str]:
    code = cli.main(["rehearse", str(sweep), "--store", str(store), "--jobs", str(jobs), "--json"])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def stored(store: Path) -> dict[str, dict]:
    """The stored rehearsals, by configuration, without the seconds spent tracing (not a result)."""
    return {p.stem: {**json.loads(p.read_text()), "trace_s": None} for p in (store / "rehearsals").glob("*.json")}


def spawned_workers(parent: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in parent.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def sigint_blocked(pid: int) -> bool:
    """Whether the process blocks SIGINT now (its SigBlk mask in /proc)."""
    mask = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & 1 << (signal.SIGINT - 1))


def test_two_workers_store_and_print_what_one_process_does(sweep, tmp_path, capsys):
    one_code, one_rows, _ = rehearse(sweep, tmp_path / "one", 1, capsys)
    assert gc.get_freeze_count() == 0  # what one process froze between configurations is unfrozen once it ends
    two_code, two_rows, _ = rehearse(sweep, tmp_path / "two", 2, capsys)
    assert one_code == two_code == 0
    plan_order = [t.config_id for t in plan(load_sweep(sweep))]
    assert [r["config_id"] for r in two_rows] == [r["config_id"] for r in one_rows] == plan_order
    assert [{**r, "trace_s": None} for r in two_rows] == [{**r, "trace_s": None} for r in one_rows]
    one, two = stored(tmp_path / "one"), stored(tmp_path / "two")
    assert sorted(two) == sorted(plan_order) and all(r["method"] == "traced" for r in two.values())
    for config in one:  # field by field
        assert two[config] == one[config]


@pytest.mark.slow  # 9 s; the default run covers the workers' path (the test above) and the message (test_rehearse_groups)
def test_a_killed_worker_leaves_what_finished_stored_and_names_what_was_not_rehearsed(sweep, tmp_path, capsys):
    store = tmp_path / "store"

    def kill_the_workers_once_a_rehearsal_is_stored():
        deadline = time.monotonic() + 300
        while not list(store.glob("rehearsals/*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        for worker in spawned_workers(psutil.Process()):
            worker.kill()

    killer = threading.Thread(target=kill_the_workers_once_a_rehearsal_is_stored, daemon=True)
    killer.start()
    code, rows, err = rehearse(sweep, store, 2, capsys)
    killer.join()
    assert code == 1
    assert "rehearsal worker process(es) died (2 killed by signal SIGKILL (e.g. out of memory))" in err, err
    lost = [int(i) for i in re.findall(r"(\d+) \([^ ]+: train\.strategy=", err)]
    printed = [r["index"] for r in rows]
    assert lost and sorted(lost + printed) == list(range(8)), (lost, printed, err)
    assert f"What finished is stored in {store}/rehearsals" in err
    configs = {t.index: t.config_id for t in plan(load_sweep(sweep))}
    assert {configs[i] for i in printed} <= set(stored(store))


def test_ctrl_c_stops_the_workers(sweep, tmp_path, sigint_as_in_a_terminal):
    cmd = [sys.executable, "-m", "raybench", "rehearse", str(sweep), "--store", str(tmp_path / "store"), "--jobs", "2"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, blocked_at_start = time.monotonic() + 120, {}
    while len(workers := spawned_workers(psutil.Process(proc.pid))) < 2 and time.monotonic() < deadline:
        blocked_at_start.update({w.pid: sigint_blocked(w.pid) for w in workers if w.pid not in blocked_at_start})
        time.sleep(0.01)
    assert len(workers) == 2
    blocked_at_start.update({w.pid: sigint_blocked(w.pid) for w in workers if w.pid not in blocked_at_start})
    # Held from its start (the first worker's start once let it through), until the worker ignores it: seen here
    # well before, as a worker imports torch first.
    assert list(blocked_at_start.values()) == [True, True]
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "raybench rehearse: interrupted; the rehearsals finished are stored in" in err
    assert "Traceback" not in err, err
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []
