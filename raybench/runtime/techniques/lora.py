"""PEFT LoRA adapters: freeze the base model and train low-rank updates on the chosen linear layers."""

from __future__ import annotations

from peft import LoraConfig, get_peft_model
from torch import nn

from raybench.spec.sweep_spec import LORA_TARGET_MODULES, TrainSpec


def wanted(train: TrainSpec) -> bool:
    return train.finetune in ("lora", "qlora")


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    lora = train.lora
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=LORA_TARGET_MODULES[lora.targets],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
