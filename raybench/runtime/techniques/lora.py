"""PEFT LoRA adapters: freeze the base model and train low-rank updates on the chosen linear layers.

The frozen base is stored in train.lora.base_dtype (auto: the compute dtype), the adapters in fp32.

Dropout on an adapter's input (train.lora.dropout > 0) is recomputed in backward rather than stored. PEFT computes
`B(A(dropout(x)))` per adapted projection, so each one keeps its own dropped copy of x for A's weight gradient and
its dropout mask: q, k and v each keep a copy of the same tensor. Here `A(dropout(x))` runs under non-reentrant
activation checkpointing with the RNG state preserved (`DroppedInputLinear`): forward keeps only x (which the base
projection keeps anyway) and the RNG state, and backward draws the same mask again from that state. The masks are
PEFT's own (drawn the same way, independent per module), so the regularizer is unchanged; what it costs is one more
dropout and one more A matmul (rank r wide) per adapter in backward. QLoRA's 4-bit layers keep PEFT's path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from raybench.spec.sweep_spec import LORA_TARGET_MODULES, TrainSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def wanted(train: TrainSpec) -> bool:
    return train.tuning.adapters


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    model = peft_lora(model, train)
    recompute_dropout(model)
    if train.lora_base_dtype is not None:  # QLoRA's base is 4-bit: nothing to cast
        store_frozen_in(model, DTYPES[train.lora_base_dtype])
    return model


def peft_lora(model: nn.Module, train: TrainSpec) -> nn.Module:
    """`model` with PEFT's LoRA adapters as train.lora asks, on PEFT's own path (dropout stored)."""
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
    return peft.get_peft_model(model, config)


class DroppedInputLinear(nn.Linear):
    """An adapter's A with its input dropout inside it: `A(dropout(x))`, recomputed in backward from x and the
    saved RNG state instead of keeping the dropped copy and the mask.

    It holds the same `weight` (and `bias`) Parameter as the nn.Linear it replaces, so the state dict's keys, and
    PEFT's files on disk, are unchanged. The cast to A's dtype (which PEFT makes before dropout: fp32 adapters
    under autocast) happens inside too, so neither the cast copy is kept."""

    def __init__(self, linear: nn.Linear, p: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):  # no mask to draw, or no backward to draw it for
            return self.dropped(x)
        return checkpoint(self.dropped, x, use_reentrant=False, preserve_rng_state=True)

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x.to(self.weight.dtype), self.p, self.training))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropout={self.p} (recomputed in backward)"


def recompute_dropout(model: nn.Module) -> None:
    """Move each plain PEFT LoRA linear's input dropout into its A (`DroppedInputLinear`), where backward
    recomputes it. PEFT's own dropout module becomes an identity; its config (and adapter_config.json) keeps the
    dropout."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for layer in model.modules():
        if type(layer) is not LoraLinear:  # QLoRA's bnb layers and other kinds keep PEFT's path
            continue
        for name, dropout in list(layer.lora_dropout.items()):
            if isinstance(dropout, nn.Dropout) and dropout.p > 0 and name not in layer.lora_variant:
                layer.lora_A[name] = DroppedInputLinear(layer.lora_A[name], dropout.p)
                layer.lora_dropout[name] = nn.Identity()
                layer.cast_input_dtype_enabled = False  # DroppedInputLinear casts inside the recomputed region


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen base weights in `dtype` (train.lora.base_dtype), on the meta device before any values
    exist: a frozen weight needs no fp32 master copy, only what gets a gradient does (the adapters stay fp32).

    `p.data = ...` swaps the storage under the same Parameter object, so a tied head stays the embedding.
    Buffers (rotary frequencies) are left fp32."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
