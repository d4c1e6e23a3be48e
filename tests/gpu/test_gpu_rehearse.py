"""The rehearsal's CPU counts against CUDA: what one compiled decoder block keeps for backward, counted on CPU
fake tensors (inductor's partitioner, no code generated), against the same block compiled by inductor and run
on the GPU. The CPU trace sees CPU kernels and CPU autocast; this says whether the partitioner's choices, and so
the rehearsed activations of compiled trials, hold on CUDA. Tensor parallelism runs on a fake 2-rank group on
one GPU (its collectives do nothing; the shapes and what is saved are a real rank's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from raybench.planning.plan import plan
from raybench.rehearse import compiled
from raybench.spec.load import parse_sweep
from raybench.spec.schema import GIB

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compiled_blocks import saved_by_real_inductor  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = {"fsdp2": (1, {"strategy": "fsdp2"}), "ddp": (1, {"strategy": "ddp"}),
         "tp": (2, {"strategy": "tp", "tp_size": 2})}


def compiled_trial(case: str):
    workers, train = CASES[case]
    spec = parse_sweep({"name": "gpu-rehearse", "model": {"preset": "tiny"},
                        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 512, "micro_batch": 2,
                                  "precision": "bf16", "compile": True, **train},
                        "resources": {"workers": workers, "gpus_per_worker": 1}})
    (trial,) = plan(spec)
    return trial


@pytest.mark.parametrize("case", CASES)
def test_a_compiled_block_keeps_on_cuda_what_the_rehearsal_counts(case):
    trial = compiled_trial(case)
    eager, kept, _ = saved_by_real_inductor(trial, device="cuda")
    assert 0 < kept < eager
    counted_eager = compiled._block_kept_bytes(trial.config, trial.shape, compiled=False, op_policy=False)
    saving = compiled.compiled_block_saving_gib(trial.config, trial.shape) * GIB
    print(f"{case}: CUDA eager {eager} compiled {kept}; CPU fake eager {counted_eager} saving {saving:.0f}")
    assert counted_eager == pytest.approx(eager, rel=0.05)
    assert saving == pytest.approx(eager - kept, rel=0.05)
