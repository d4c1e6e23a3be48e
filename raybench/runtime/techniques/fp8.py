"""FP8 matmuls through torchao's float8 training (train.fp8: tensorwise or rowwise, torchao's recipe names).

Each eligible linear layer of the decoder becomes torchao's Float8Linear: its input, weight and output gradient are
cast to float8 with dynamic scales and multiplied on the FP8 tensor cores; the weights stay in their own dtype
(bf16 or fp32) for the optimizer. Eligible: an nn.Linear inside a decoder block whose dimensions are multiples of
16 (the FP8 kernels' tile), never the output head (its logits feed the loss, which FP8 would coarsen; torchtitan
leaves it out too), and under LoRA only the frozen base linears (the adapters are rank-r matrices, too small to
gain). tensorwise under fsdp2 all-gathers the weights in FP8 (torchao's enable_fsdp_float8_all_gather), half the
bytes of bf16; not for a frozen LoRA base, whose weights torchao's FP8 all-gather does not take.

torchao is an optional extra (`raybench[gpu]`), imported only on a worker that asked for it. The technique runs
before activation checkpointing and compile (worker.TECHNIQUES): both see the Float8Linear modules.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from raybench.spec.sweep_spec import TrainSpec

TILE = 16  # FP8 GEMMs need both dimensions of the weight to be multiples of this
# FP8 tensor cores: compute capability 8.9 (Ada: L40S) and 9.0 (Hopper) on; the A100 (8.0) has none.
MIN_CAPABILITY = (8, 9)


def wanted(train: TrainSpec) -> bool:
    return train.fp8 != "off"


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    # The model is still on the meta device (worker.build_and_wrap materializes it after the techniques): ask the
    # device, not the parameters.
    if not torch.cuda.is_available():
        raise ValueError(f"train.fp8={train.fp8} needs CUDA GPUs with FP8 tensor cores; on CPU set train.fp8: off")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ValueError(f"train.fp8={train.fp8} needs FP8 tensor cores (compute capability 8.9 or above: L40S, "
                         f"H100, H200, B200); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: "
                         "set train.fp8: off")
    return convert(model, train)


def convert(model: nn.Module, train: TrainSpec, emulate: bool = False) -> nn.Module:
    """Swap the eligible linears for torchao's Float8Linear. emulate=True runs the casts and scales in plain
    matmuls (torchao's emulation, for checks on machines without FP8 tensor cores)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ImportError("train.fp8 needs torchao on every worker: pip install 'raybench[gpu]'") from None
    config = Float8LinearConfig.from_recipe_name(train.fp8)
    all_gather_fp8 = train.fp8 == "tensorwise" and train.strategy == "fsdp2" and train.finetune == "full"
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather_fp8, emulate=emulate)
    lora = train.finetune == "lora"
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, fqn: eligible(module, fqn, lora))


def eligible(module: nn.Module, fqn: str, lora: bool) -> bool:
    """Whether the linear `module` (named `fqn` in the model) runs in FP8 (see the module doc)."""
    if not isinstance(module, nn.Linear) or ".layers." not in f".{fqn}":
        return False
    if module.in_features % TILE or module.out_features % TILE:
        return False
    return fqn.endswith("base_layer") if lora else True


def converted(model: nn.Module) -> list[str]:
    """The names of the model's linears that run in FP8."""
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
