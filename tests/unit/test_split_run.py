"""`raybench run` in two processes (drivers/split_run.py): under `--cluster` and in a one-shot SLURM job the sweep's
driver runs in a child, and should Ray end that child without a word at a stop, the parent stores what the child
had running as `interrupted`. Here the child is a plain Python script playing the driver's part (a journal, then
death by SIGKILL as Ray's C++ core ends it); no Ray, no SLURM: tests/integration/test_cluster_faults.py does it
on the real 2-node test SLURM."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raybench.drivers.ray_cluster import Terminated, terminate_on_sigterm


def test_a_second_sigterm_during_the_stop_is_the_same_stop():
    # In a one-shot job SLURM sends SIGTERM to every process of the job, and `raybench run` passes its own on to the
    # sweep's driver: the driver gets two. The second must not break its teardown (the `interrupted` rows' second
    # check runs there), at any depth of the nested handlers (`run`'s own, the sweep's).
    stops, torn_down = [], []
    with pytest.raises(Terminated, match="received signal 15"):
        with terminate_on_sigterm():
            try:
                with terminate_on_sigterm(stops.append):
                    try:
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(5)
                    finally:  # Ray's teardown
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(0.2)
                        torn_down.append("ray")
            finally:  # the rows checked again once Ray is down (sweep.record_interrupted)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                torn_down.append("rows")
    assert torn_down == ["ray", "rows"] and stops == ["received signal 15"]
    # Once the sweep has stopped, SIGTERM is SIGTERM again: the next sweep's stop is its own.
    with pytest.raises(Terminated):
        with terminate_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
