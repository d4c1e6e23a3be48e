"""What a trial trains (`train.finetune`), as typed facts the rest of raybench reads: every weight, LoRA adapters
over a frozen base, or adapters over a 4-bit base. Nothing outside this file compares a finetune mode's name (a
stack's own vocabulary, torchtune's recipe kinds say, maps to these in its own file).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finetune:
    name: str
    description: str
    trains_base: bool = False  # every weight is trained: fp32 master weights, gradients and optimizer state for all
    adapters: bool = False  # LoRA adapters are trained over a frozen base (train.lora)
    quantized_base: bool = False  # the frozen base is 4-bit NF4 (bitsandbytes, CUDA only; its base is not sharded)


FULL = Finetune("full", "train every weight", trains_base=True)
LORA = Finetune("lora", "LoRA adapters over a frozen base in train.lora.base_dtype", adapters=True)
QLORA = Finetune("qlora", "LoRA over a 4-bit bitsandbytes base (CUDA only)", adapters=True, quantized_base=True)

FINETUNES: dict[str, Finetune] = {f.name: f for f in (FULL, LORA, QLORA)}
