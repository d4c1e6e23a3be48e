"""The warm pool on a GPU: trials leave no GPU memory behind (else the group is replaced and the next trial's
peak would include the leftovers), DeepSpeed ZeRO-3 runs after ZeRO-2 in the same warm process, and what Liger
and ZeRO-3 patch process-wide is put back (and their group replaced)."""

from __future__ import annotations

import pytest
import ray
import torch

from raybench.drivers.executors.pool import manager
from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.sweep import run_planned
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

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
    # Liger is shipped to a GPU machine only with its wheel: without it, skip (a failure stopped the -x run)
    apply_liger_kernel_to_llama = pytest.importorskip("liger_kernel.transformers").apply_liger_kernel_to_llama
    import deepspeed
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama

    from raybench.runtime import isolation

    linear, rms_norm = F.linear, modeling_llama.LlamaRMSNorm
    before = isolation.snapshot()
    apply_liger_kernel_to_llama()  # replaces transformers' module-level classes and functions
    deepspeed.zero.Init(module=torch.nn.Linear(8, 8).cuda(), config_dict_or_path={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # patches F.linear
    assert modeling_llama.LlamaRMSNorm is not rms_norm
    changed = isolation.restore(before)
    assert F.linear is linear and modeling_llama.LlamaRMSNorm is rms_norm
    assert "transformers.models.llama.modeling_llama.LlamaRMSNorm" in changed


def test_gpu_memory_an_earlier_trial_left_is_not_in_the_next_peak(tmp_path):
    """Below the 0.25 GiB recycle limit a leftover stays in the actor: the next trial's GPU peaks are net of it,
    so the same trial reports the same peak as before the leftover (as a fresh process would)."""
    def hold_gpu_tensor(actor_self, gib: float) -> None:
        # Runs inside the pool actor (a local function: cloudpickle sends it by value): keep a CUDA tensor alive
        # after its trial, as a leak in some library would.
        actor_self.leftover = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")

    def sweep(lr: float):
        return parse_sweep({"name": "gpu-leftover", "model": {"preset": "tiny"}, "executor": "pool",
                            "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64, "precision": "bf16",
                                      "strategy": "fsdp2", "lr": lr},
                            "resources": {"workers": 1, "gpus_per_worker": 1}})

    with ray_cluster(None):
        first = sweep(1e-4)
        run_planned(plan(first), first.name, str(tmp_path), "pool", progress=lambda line: None)
        (group,) = ray.get(manager().groups_info.remote())
        ray.get(group["actors"][0].__ray_call__.remote(hold_gpu_tensor, 0.1))
        second = sweep(2e-4)
        run_planned(plan(second), second.name, str(tmp_path), "pool", progress=lambda line: None)
    rows = store.read_results(tmp_path, "gpu-leftover").sort_values("ended_at")
    assert list(rows.status) == ["ok", "ok"] and list(rows.process_trial_index) == [0, 1]
    before, after = rows.peak_alloc_gib.tolist()
    assert after == pytest.approx(before, abs=0.02)  # the 0.1 GiB leftover is not counted
