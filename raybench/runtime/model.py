"""What the rest of the runtime (strategies, techniques) and the rehearsal need to know of a model's architecture:
its decoder blocks, its parameter counts, a config with fewer blocks. Building a rank's model is `runtime.build`'s,
which imports this module (as strategies and techniques do), never the other way round.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


def with_layers(config, layers: int):
    """A copy of a transformers config with `layers` decoder blocks. Only for models whose blocks are all alike:
    a config listing different layer types (sliding and full attention) raises ValueError."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ValueError(f"decoder blocks of several types {sorted(kinds)}")
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if kinds:
        config.layer_types = [kinds.pop()] * layers
    return config


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
