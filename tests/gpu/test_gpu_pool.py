"""The warm pool on a GPU: trials leave no GPU memory behind (else the group is replaced and the next trial's
peak would include the leftovers), DeepSpeed ZeRO-3 runs after ZeRO-2 in the same warm process, and what Liger
and ZeRO-3 patch process-wide is put back (and their group replaced)."""

from __future__ import annotations

import pytest
import ray
import torch

from raybench import store
from raybench.config import parse_sweep
from raybench.executors.pool import manager
from raybench.plan import plan
from raybench.sweep import ray_cluster, run_planned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_pool_trials_on_gpu_reuse_one_clean_group(tmp_path):
    spec = parse_sweep({"name": "gpu-pool", "model": {"preset": "tiny"}, "executor": "pool",
                        "train": {"steps": 6, "warmup_steps": 1, "seq_len": 64, "precision": "bf16"},
                        "resources": {"workers": 1, "gpus_per_worker": 1},
                        "axes": {"setup": [{"train.strategy": "fsdp2"},
                                           {"train.strategy": "deepspeed", "train.zero_stage": 2},
                                           {"train.strategy": "deepspeed", "train.zero_stage": 3},
                                           {"train.strategy": "ddp"}]}})
    with ray_cluster(None):
        run_planned(plan(spec), spec.name, str(tmp_path), "pool", progress=lambda line: None)
        rows = store.read_results(tmp_path, spec.name).sort_values("ended_at")
        assert list(rows.status) == ["ok"] * 4, list(rows.message)
        # ZeRO-3 patched torch.nn.functional.linear: its group was replaced after it, so ddp ran in a new one.
        assert list(rows.process_trial_index) == [0, 1, 2, 0]
        (group,) = ray.get(manager().groups_info.remote())
        assert ray.get(group["actors"][0].after_trial.remote()) == {"leftover_gib": pytest.approx(0, abs=0.25),
                                                                   "changed": []}


def test_liger_and_zero3_patches_are_restored():
    import deepspeed
    import torch.nn.functional as F
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    from raybench import isolation

    linear, rms_norm = F.linear, modeling_llama.LlamaRMSNorm
    before = isolation.snapshot()
    apply_liger_kernel_to_llama()  # replaces transformers' module-level classes and functions
    deepspeed.zero.Init(module=torch.nn.Linear(8, 8).cuda(), config_dict_or_path={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # patches F.linear
    assert modeling_llama.LlamaRMSNorm is not rms_norm
    changed = isolation.restore(before)
    assert F.linear is linear and modeling_llama.LlamaRMSNorm is rms_norm
    assert "transformers.models.llama.modeling_llama.LlamaRMSNorm" in changed
