"""What the GPU rounds' tests share (tests/unit/test_gpu_*_round.py): a sweep file's fields flattened for comparing
a round's GPU sweep with its CPU twin, the files a round's data stage writes on the GPU machine, and the rows a
round's summary reads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from raybench.planning.plan import plan
from raybench.spec.load import load_sweep
from tests import bench_script

REPO = Path(__file__).resolve().parents[1]


def flat(node: dict, prefix: str = "") -> dict:
    """A sweep's fields by dotted name (resources and axes whole)."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in ("resources", "axes"):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def twin_changes(gpu: Path, twin: Path) -> set[str]:
    """The fields (flat names) a round's CPU twin sweep sets otherwise than its GPU sweep."""
    a, b = (flat(yaml.safe_load(path.read_text())) for path in (gpu, twin))
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def planned_rows(path: Path) -> pd.DataFrame:
    """Rows as the runner stores them for each planned trial (axis_values_json), all ok, each with a loss by step
    of its own, so that a comparison is found only where the grouping pairs a point with its baseline."""
    trials = plan(load_sweep(path))
    return pd.DataFrame({
        "trial_id": [t.trial_id for t in trials], "status": "ok",
        "axis_values_json": [json.dumps(t.axis_values, sort_keys=True) for t in trials],
        "loss_by_step": [[12.0 + i / 100] * 4 for i in range(len(trials))]})


def write_round_data(sweeps: Path) -> None:
    """sweeps/example-data as the GPU machine has it once the stage wrote its files: the twin's model and chats as
    bench/stack_round_data.py writes them; for the GPU sweeps, the 1B's config.json beside an empty safetensors
    file (planning reads the config only) and fewer chats."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from raybench.spec.presets import PRESETS

    script = bench_script.load(REPO / "bench" / "stack_round_data.py")
    script.write(sweeps / "example-data" / "stack-round-twin", "tiny", "bf16", "cpu", chats=20)
    model = sweeps / "example-data" / "stack-round" / "model"
    shape = PRESETS["llama-3.2-1b"]
    AutoConfig.for_model(shape.model_type, **shape.hf_config_kwargs()).save_pretrained(model)
    save_file({}, model / "model.safetensors")
    script.write_data(sweeps / "example-data" / "stack-round", chats=20)
