"""A command stack's rank killed by a signal after training (tests/stacks_user/probe_train.py --mode abort: rank 1
draws a progress bar, then SIGABRT) is an error row naming the rank, the signal and the last real error line, run
under torchrun on this machine (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raybench.drivers import executors
from raybench.drivers.trial import classify
from raybench.planning.plan import plan
from raybench.spec.load import load_sweep

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[1] / "stacks_user" / "probe_train.py"


def test_a_rank_aborted_after_training_is_named_with_its_signal(tmp_path):
    sweep = tmp_path / "abort.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "abort", "executor": "torchrun", "model": {"preset": "tiny"},
        "train": {"steps": 2, "warmup_steps": 1, "micro_batch": 1, "seq_len": 8},
        "resources": {"workers": 2, "cpus_per_worker": 1, "timeout_s": 120},
        "stack": {"kind": "command", "command": [
            "{python}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{workers}", str(SCRIPT),
            "--steps", "{steps}", "--micro-batch", "{micro_batch}", "--seq-len", "{seq_len}", "--mode", "abort"]}}))
    trial = plan(load_sweep(sweep))[0]
    with pytest.raises(RuntimeError) as failed:
        executors.get("torchrun")(trial.payload)
    assert classify(failed.value) == ("error", "rank 1 was killed by signal SIGABRT (exit code -6); its last error "
                                               "line: terminate called without an active exception")
