"""The warm pool on a GPU: trials leave no GPU memory behind (else the group is replaced and the next trial's
peak would include the leftovers), and DeepSpeed ZeRO-3 runs after ZeRO-2 in the same warm process."""

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
        (group,) = ray.get(manager().groups_info.remote())
        assert group["trials_run"] == 4  # never replaced: no trial left GPU memory allocated
        assert ray.get(group["actors"][0].device_leftover_gib.remote()) < 0.25
