"""Faults inside one trial, on the Ray-free torchrun executor: a stuck rank, a killed rank, a rank over its
memory cap. Each must end as one row with the right status, with no process of the trial left running."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from raybench.cli import main as cli
from raybench.results import store

pytestmark = pytest.mark.integration


def _sweep(tmp_path, resources: str, train: str = "steps: 100000, warmup_steps: 1, seq_len: 64"):
    path = tmp_path / "faults.yaml"
    path.write_text(f"name: faults\nmodel: {{preset: tiny}}\n"
                    f"train: {{{train}, precision: fp32, strategy: ddp}}\n"
                    f"resources: {{workers: 2, {resources}}}\nstore: {tmp_path / 'store'}\n")
    return path


def _ranks() -> dict[int, psutil.Process]:
    """This test process's torchrun ranks by RANK (found through the process tree, never by name)."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if "raybench.runtime.worker" in proc.cmdline() and "RANK" in proc.environ():
                found[int(proc.environ()["RANK"])] = proc
        except psutil.Error:
            continue
    return found


class RankSignaller(threading.Thread):
    """Once rank 1 exists and has run `after_s`, send it `sig`; remember every rank seen."""

    def __init__(self, sig: int, after_s: float):
        super().__init__(daemon=True)
        self.sig, self.after_s, self.seen, self.sent = sig, after_s, {}, threading.Event()
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.2):  # a 0.2 s poll of the process table, not a spin
            self.seen.update(_ranks())
            if 1 in self.seen and time.time() - self.seen[1].create_time() >= self.after_s:
                os.kill(self.seen[1].pid, self.sig)
                self.sent.set()
                return


def _run_trial(sweep) -> tuple[int, float]:
    t0 = time.perf_counter()
    code = cli.main(["trial", str(sweep), "0"])
    return code, time.perf_counter() - t0


def _gone(procs) -> bool:
    _, alive = psutil.wait_procs(list(procs), timeout=10)
    return not alive


def test_timeout_ends_stuck_rank_and_kills_every_process(tmp_path):
    # SIGSTOP on rank 1 is a real hang: rank 0 blocks in its next collective and never returns.
    signaller = RankSignaller(signal.SIGSTOP, after_s=2)
    signaller.start()
    code, wall = _run_trial(_sweep(tmp_path, "timeout_s: 15"))
    signaller.stop.set()
    assert signaller.sent.is_set() and code == 1
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == "timeout" and "timeout_s=15" in row.message
    # How far it got, from the ranks' marks: rank 1 stopped (before its process group formed, or in a step), so
    # the row never reads "slow"; the marks are gone with the trial.
    assert "how far: " in row.message and "slow, not hung" not in row.message, row.message
    assert not (tmp_path / "store" / "_cache" / "progress").exists() or not any(
        (tmp_path / "store" / "_cache" / "progress").iterdir())
    assert wall < 15 + 15  # the kill is prompt: SIGTERM, a grace period, SIGKILL
    assert _gone(signaller.seen.values())  # the stopped rank too: its resources are free


def test_kill_one_rank_gives_error_row(tmp_path):
    signaller = RankSignaller(signal.SIGKILL, after_s=3)
    signaller.start()
    code, wall = _run_trial(_sweep(tmp_path, "timeout_s: 120"))
    signaller.stop.set()
    assert signaller.sent.is_set() and code == 1
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == "error" and row.message
    assert wall < 60  # torchrun noticed the dead rank; nobody waited for the timeout
    assert _gone(signaller.seen.values())


@pytest.mark.parametrize("cap_gib, seq_len, micro_batch, status", [
    (0.6, 1024, 16, "oom"),
    # In the default run, test_estimate_trial runs the same trial (ddp, seq 64, micro-batch 2) under this cap.
    pytest.param(4, 64, 2, "ok", marks=pytest.mark.slow)])
def test_oom_host_memory_limit(tmp_path, cap_gib, seq_len, micro_batch, status):
    # 16 × 1024 tokens × vocab 2000 fp32 logits alone are 0.12 GiB, with several copies in backward: far over
    # 0.6 GiB. The small trial shows that a cap with room to spare changes nothing.
    train = f"steps: 3, warmup_steps: 1, seq_len: {seq_len}, micro_batch: {micro_batch}"
    code, _ = _run_trial(_sweep(tmp_path, f"memory_limit_gib: {cap_gib}", train))
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == status, row.message
    assert code == (0 if status == "ok" else 1)
    if status == "oom":
        assert "can't allocate memory" in row.message and "host RSS peak" in row.message  # memory at OOM
