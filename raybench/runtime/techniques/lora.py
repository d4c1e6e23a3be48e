"""PEFT LoRA adapters: freeze the base model and train low-rank updates on the chosen linear layers.

The frozen base is stored in train.lora.base_dtype (auto: the compute dtype), the adapters in fp32."""

from __future__ import annotations

import torch
from torch import nn

from raybench.spec.sweep_spec import LORA_TARGET_MODULES, TrainSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def wanted(train: TrainSpec) -> bool:
    return train.finetune in ("lora", "qlora")


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    # Imported here, not with the module: peft takes about half of a rank's start-up imports (2.2 s of 4.3 s on a
    # 2-core host), which every trial that trains no adapters would pay.
    import peft

    lora = train.lora
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=LORA_TARGET_MODULES[lora.targets],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, config)
    if train.lora_base_dtype is not None:  # QLoRA's base is 4-bit: nothing to cast
        store_frozen_in(model, DTYPES[train.lora_base_dtype])
    return model


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen base weights in `dtype` (train.lora.base_dtype), on the meta device before any values
    exist: a frozen weight needs no fp32 master copy, only what gets a gradient does (the adapters stay fp32).

    `p.data = ...` swaps the storage under the same Parameter object, so a tied head stays the embedding.
    Buffers (rotary frequencies) are left fp32."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
