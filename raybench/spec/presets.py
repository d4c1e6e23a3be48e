"""Architecture shapes: the built-in presets and the shape of a local Hugging Face model directory.

Pure data and JSON reading only (no torch), so that `validate` and `plan` stay fast and start nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The numbers planning, estimates and the FLOP model need; field names follow Hugging Face configs."""

    model_type: str  # "llama" or "qwen2": the transformers architecture built from this shape
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    def hf_config_kwargs(self) -> dict:
        kwargs = asdict(self)
        kwargs.pop("model_type")
        return kwargs


# Shapes copied from the public config.json of each model; weights are random (throughput does not depend on them).
PRESETS: dict[str, ModelShape] = {
    # Small enough for 2-rank gloo tests on a laptop CPU; 4 heads / 2 KV heads so TP=2 divides both.
    "tiny": ModelShape("llama", 128, 4, 4, 2, 256, 2000, 2048, False),
    "llama-3.2-1b": ModelShape("llama", 2048, 16, 32, 8, 8192, 128256, 131072, True),
    "llama-3-8b": ModelShape("llama", 4096, 32, 32, 8, 14336, 128256, 8192, False),
    "llama-3.1-8b": ModelShape("llama", 4096, 32, 32, 8, 14336, 128256, 131072, False),  # 3-8b, 128K positions
    "llama-3-70b": ModelShape("llama", 8192, 80, 64, 8, 28672, 128256, 8192, False),
    "llama-2-7b": ModelShape("llama", 4096, 32, 32, 32, 11008, 32000, 4096, False),
    "llama-2-13b": ModelShape("llama", 5120, 40, 40, 40, 13824, 32000, 4096, False),
    "codellama-34b": ModelShape("llama", 8192, 48, 64, 8, 22016, 32000, 16384, False),
    "llama-2-70b": ModelShape("llama", 8192, 80, 64, 8, 28672, 32000, 4096, False),
    # Llama 2's shapes with RoPE stretched to 32,768 positions, as long-context fine-tunes of Llama 2 ship them
    # (Together's LLaMA-2-7B-32K) and as xtuner's speed benchmark trains them at 8k-32k. Rotary positions have no
    # table: only the limit differs from llama-2-7b and llama-2-70b.
    "llama-2-7b-32k": ModelShape("llama", 4096, 32, 32, 32, 11008, 32000, 32768, False),
    "llama-2-70b-32k": ModelShape("llama", 8192, 80, 64, 8, 28672, 32000, 32768, False),
    "yi-34b-200k": ModelShape("llama", 7168, 60, 56, 8, 20480, 64000, 200000, False),
    # KempnerForge's "13B" (Llama 3 layout, its benchmarks/mfu_scaling report): ffn 1.3 x 8/3 x 5120 rounded up to
    # 256, which gives its stated 14.84B parameters. Not a released model; a shape its published rows ran.
    "kempnerforge-13b": ModelShape("llama", 5120, 40, 40, 8, 17920, 128256, 8192, False),
    "qwen2.5-14b": ModelShape("qwen2", 5120, 48, 40, 8, 13824, 152064, 131072, False),
    "qwen2.5-32b": ModelShape("qwen2", 5120, 64, 40, 8, 27648, 152064, 131072, False),
    "qwen2.5-72b": ModelShape("qwen2", 8192, 80, 64, 8, 29568, 152064, 131072, False),
}


def shape_from_model_dir(path: str | Path) -> ModelShape:
    """Read the shape of a local Hugging Face model directory from its config.json (no weights are read)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return ModelShape(
        model_type=cfg.get("model_type", "llama"),
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def model_shape(config) -> ModelShape:
    """The shape of a trial config's model: its preset, or its local directory's config.json."""
    if config.model.preset is not None:
        return PRESETS[config.model.preset]
    return shape_from_model_dir(Path(config.model.path))
