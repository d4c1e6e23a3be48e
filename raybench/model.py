"""Build the model a trial benchmarks: a preset with random weights, or a local Hugging Face directory.

Weights load from safetensors only unless the sweep sets model.allow_pickle; nothing is ever downloaded.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from raybench.config import ModelSpec, check_model_dir
from raybench.presets import PRESETS

log = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: torch.device, seed: int) -> nn.Module:
    """Return the causal LM in fp32 on `device`, identical on every rank (same seed, same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if spec.preset is not None:
        shape = PRESETS[spec.preset]
        hf_config = AutoConfig.for_model(shape.model_type, **shape.hf_config_kwargs(), use_cache=False)
        with device:
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch.float32, attn_implementation=spec.attn_implementation
            )
        return model
    problems = check_model_dir(spec.path, spec.allow_pickle)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    if spec.allow_pickle:
        log.warning("model.allow_pickle is set: pickle weights in %s can run arbitrary code when loaded", spec.path)
    model = AutoModelForCausalLM.from_pretrained(
        spec.path,
        dtype=torch.float32,
        local_files_only=True,
        use_safetensors=None if spec.allow_pickle else True,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    model.config.use_cache = False
    return model.to(device)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks (found by name so PEFT wrappers and other architectures work)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return module
    raise ValueError(f"no decoder-block ModuleList named '*layers' in {type(model).__name__}")


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts before sharding."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
