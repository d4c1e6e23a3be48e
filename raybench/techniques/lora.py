"""PEFT LoRA adapters: freeze the base model and train low-rank updates on the chosen linear layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raybench.config import LoraSpec

if TYPE_CHECKING:  # TARGETS is read by the torch-free estimate; torch is imported where adapters are made
    from torch import nn

# Module names shared by the Llama and Qwen2 families.
TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "attention_mlp": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "all_linear": "all-linear",  # PEFT's keyword: every linear layer except the output head
}


def apply(model: nn.Module, lora: LoraSpec) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=TARGETS[lora.targets],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
