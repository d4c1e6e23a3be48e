"""Build the model a trial benchmarks: a preset with random weights, or a local Hugging Face directory.

Weights load from safetensors only unless the sweep sets model.allow_pickle; nothing is ever downloaded.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from raybench import weights
from raybench.config import ModelSpec, check_model_dir
from raybench.presets import PRESETS

log = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: torch.device, seed: int, local_copy: str = "never",
                cache_gib: float = 0.0) -> tuple[nn.Module, dict]:
    """The causal LM in fp32 on `device`, identical on every rank (same seed, same weights), and where its
    weights came from: {"weights_cache": "hit" | "miss" | None, "weights_copy_s": seconds copying or None}.

    local_copy (auto | always | never) loads a model directory from a node-local copy; cache_gib > 0 keeps
    the weights in this process's memory for the next trial on the same model (warm pool actors).
    """
    info = {"weights_cache": None, "weights_copy_s": None}
    model = _build(spec, device, seed, local_copy, cache_gib, info)
    torch.manual_seed(seed)  # what comes next (LoRA init) draws the same numbers whether the cache hit or not
    return model, info


def _build(spec: ModelSpec, device: torch.device, seed: int, local_copy: str, cache_gib: float,
           info: dict) -> nn.Module:
    path = spec.path
    if path is not None:
        problems = check_model_dir(path, spec.allow_pickle)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
        if weights.wants_copy(path, local_copy):
            t0 = time.perf_counter()
            path = str(weights.node_local_copy(path)[0])
            info["weights_copy_s"] = time.perf_counter() - t0
    key = None
    if cache_gib > 0:
        key = f"preset:{spec.preset}:{seed}" if path is None else f"dir:{weights.model_key(Path(path))}"
        key += f":{spec.attn_implementation}"
        cached = weights.STATE_CACHE.get(key)
        if cached is not None:
            info["weights_cache"] = "hit"
            return _from_state(_hf_config(spec, path), spec, cached, device)
        info["weights_cache"] = "miss"
    torch.manual_seed(seed)
    model = _load(spec, path, device)
    budget = int(cache_gib * 2**30)
    # Only copy what the cache can keep: a model over the budget (a 1B model in fp32 over the default 4 GiB)
    # would cost every trial a host copy of its weights, counted in its build time and peak RSS.
    if key is not None and sum(t.numel() * t.element_size() for _, t in _tensors(model)) <= budget:
        state = {name: t.detach().to("cpu", copy=True) for name, t in _tensors(model)}
        weights.STATE_CACHE.put(key, state, budget)
    return model


def _hf_config(spec: ModelSpec, path: str | None):
    from transformers import AutoConfig

    if path is None:
        shape = PRESETS[spec.preset]
        return AutoConfig.for_model(shape.model_type, **shape.hf_config_kwargs(), use_cache=False)
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    config.use_cache = False
    return config


def _load(spec: ModelSpec, path: str | None, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if path is None:
        with device:
            return AutoModelForCausalLM.from_config(
                _hf_config(spec, None), dtype=torch.float32, attn_implementation=spec.attn_implementation
            )
    if spec.allow_pickle:
        log.warning("model.allow_pickle is set: pickle weights in %s can run arbitrary code when loaded", path)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        local_files_only=True,
        use_safetensors=None if spec.allow_pickle else True,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    model.config.use_cache = False
    return model.to(device)


def _tensors(model: nn.Module):
    # Parameters and buffers: non-persistent buffers (rotary frequencies) are not in state_dict() but must be set.
    return itertools.chain(model.named_parameters(), model.named_buffers())


def _from_state(hf_config, spec: ModelSpec, state: dict, device: torch.device) -> nn.Module:
    """Build the architecture without initialising it (meta device), then fill it from cached tensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                 attn_implementation=spec.attn_implementation,
                                                 trust_remote_code=spec.trust_remote_code)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in _tensors(model):
            tensor.copy_(state[name])
    return model


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks (found by name so PEFT wrappers and other architectures work)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return module
    raise ValueError(f"no decoder-block ModuleList named '*layers' in {type(model).__name__}")


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts before sharding, in weights: a quantized weight counts its original
    shape, not its packed storage."""
    total = sum(_weight_count(p) for p in model.parameters())
    trainable = sum(_weight_count(p) for p in model.parameters() if p.requires_grad)
    return total, trainable


def _weight_count(param: torch.Tensor) -> int:
    """How many weights a parameter holds.

    A bitsandbytes 4-bit weight (QLoRA) is stored packed, two 4-bit values per uint8 element, so its numel()
    is half the layer's weights; its quant_state keeps the original shape. The FLOP model needs the weights.
    """
    quant_state = getattr(param, "quant_state", None)
    if quant_state is None:  # a plain tensor, or a 4-bit weight not yet quantized (still its original shape)
        return param.numel()
    return math.prod(quant_state.shape)
