"""What the GPU rounds' tests share (tests/unit/test_gpu_*_round.py): a sweep file's fields flattened for comparing
a round's GPU sweep with its CPU twin, and the files a round's data stage writes on the GPU machine."""

from __future__ import annotations

from pathlib import Path

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
