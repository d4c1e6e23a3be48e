"""QLoRA's base model: the decoder blocks' linear layers become 4-bit NF4 bitsandbytes layers (CUDA only).

LoRA adapters (techniques/lora.py) then train on top of the frozen 4-bit weights in bf16. The embeddings and
the LM head stay unquantized, as in the QLoRA paper. bitsandbytes is an optional extra (`raybench[gpu]`) and is
only imported here, on a worker that asked for QLoRA.
"""

from __future__ import annotations

import torch
from torch import nn

from raybench.runtime.model import decoder_blocks
from raybench.spec.sweep_spec import TrainSpec

COMPUTE_DTYPE = torch.bfloat16  # 4-bit weights are dequantized to this for each matmul


def wanted(train: TrainSpec) -> bool:
    return train.tuning.quantized_base


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    """Swap every nn.Linear inside the decoder blocks for a frozen NF4 Linear4bit, in place."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError("train.finetune=qlora needs CUDA GPUs (bitsandbytes 4-bit kernels); on CPU use "
                         "train.finetune: lora")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImportError("train.finetune=qlora needs bitsandbytes on every worker: pip install 'raybench[gpu]'") \
            from None
    for block in decoder_blocks(model):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, _linear4bit(bnb, child, device))
    return model


def _linear4bit(bnb, linear: nn.Linear, device: torch.device) -> nn.Module:
    quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=COMPUTE_DTYPE, quant_type="nf4")
    quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return quantized.to(device)  # moving a Params4bit to the GPU is what quantizes it
