"""Ray Train V2: one TorchTrainer per trial, run from inside the trial's Ray Tune driver.

Workers report nothing during the loop (a Train V2 report costs ~1.6 s); rank 0's return value carries the
metrics back through `Result.return_value`.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path


def _train_loop(payload: dict) -> dict | None:
    from raybench import worker

    return worker.run(payload)


def execute(payload: dict) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = payload["config"]["resources"]
    use_gpu = resources["gpus_per_worker"] > 0
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config=payload,
        scaling_config=ScalingConfig(
            num_workers=resources["workers"],
            use_gpu=use_gpu,
            resources_per_worker={"CPU": resources["cpus_per_worker"], **({"GPU": 1} if use_gpu else {})},
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            name=f"{payload['trial_id']}-{uuid.uuid4().hex[:8]}",
            storage_path=str(Path(tempfile.gettempdir()) / "raybench-train"),
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    if not isinstance(result.return_value, dict):
        raise RuntimeError("rank 0 returned no metrics")
    return result.return_value
