"""train.master_weights none: the weights kept in bf16 (pure bf16 training, as KempnerForge trains), so that their
gradients and the optimizer's state, which take the weights' dtype, are bf16 too: half the memory of fp32 master
weights under bf16 compute, without an fp32 copy to round small updates into.

Cast on the meta device, before any values exist (the build then gives the weights their values in bf16, from a
random init or from safetensors), as the LoRA technique keeps a frozen base in its dtype. Buffers (the rotary
frequencies) stay fp32. The plan allows it for a full fine-tune in precision bf16 under ddp, fsdp2 and tp
(spec/options.py)."""

from __future__ import annotations

import torch
from torch import nn

from raybench.spec.sweep_spec import TrainSpec


def wanted(train: TrainSpec) -> bool:
    return train.master_weights == "none"


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch.bfloat16:
            param.data = param.data.to(torch.bfloat16)  # the same Parameter: a tied head stays the embedding
    return model
