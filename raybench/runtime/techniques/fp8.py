"""FP8 matmuls through torchao's float8 training (train.fp8: tensorwise or rowwise, torchao's recipe names).

Each eligible linear layer of the decoder becomes torchao's Float8Linear: its input, weight and output gradient are
cast to float8 with dynamic scales and multiplied on the FP8 tensor cores; the weights stay in their own dtype
(bf16 or fp32) for the optimizer. Eligible: an nn.Linear inside a decoder block whose dimensions are multiples of
16 (the FP8 kernels' tile), never the output head (its logits feed the loss, which FP8 would coarsen; torchtitan
leaves it out too), and under LoRA only the frozen base linears (the adapters are rank-r matrices, too small to
gain). tensorwise under fsdp2 all-gathers the weights in FP8 (torchao's enable_fsdp_float8_all_gather), half the
bytes of bf16; not for a frozen LoRA base, whose weights torchao's FP8 all-gather does not take.

torchao is an optional extra (`raybench[gpu]`), imported only on a worker that asked for it. The technique runs
before activation checkpointing and compile (build.TECHNIQUES): both see the Float8Linear modules.

Under LoRA, torchao 0.18's Float8Linear computes the frozen base's weight gradient too (and keeps its input for
it), then drops it: the rehearsal counts that work (docs/rehearse.md, FP8), the row's FLOPs do not (`columns`).
"""

from __future__ import annotations

import dataclasses
import json
import re

import torch
from torch import nn

from raybench.spec.finetunes import LORA
from raybench.spec.sweep_spec import TrainSpec

TILE = 16  # FP8 GEMMs need both dimensions of the weight to be multiples of this
# FP8 tensor cores: compute capability 8.9 (Ada: L40S) and 9.0 (Hopper) on; the A100 (8.0) has none.
MIN_CAPABILITY = (8, 9)


def wanted(train: TrainSpec) -> bool:
    return train.fp8 != "off"


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    check_device(train)
    return convert(model, train)


def check_device(train: TrainSpec) -> None:
    """Refuse a rank whose GPU has no FP8 tensor cores (the plan refuses CPU trials; it cannot see the GPU)."""
    # The model is still on the meta device (build.build_and_wrap materializes it after the techniques): ask the
    # device, not the parameters.
    if not torch.cuda.is_available():
        raise ValueError(f"train.fp8={train.fp8} needs CUDA GPUs with FP8 tensor cores; on CPU set train.fp8: off")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ValueError(f"train.fp8={train.fp8} needs FP8 tensor cores (compute capability 8.9 or above: L40S, "
                         f"H100, H200, B200); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: "
                         "set train.fp8: off")


def convert(model: nn.Module, train: TrainSpec, emulate: bool = False) -> nn.Module:
    """Swap the eligible linears for torchao's Float8Linear. emulate=True runs the casts and scales in plain
    matmuls (torchao's emulation, for checks on machines without FP8 tensor cores)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ImportError("train.fp8 needs torchao on every worker: pip install 'raybench[gpu]'") from None
    config = Float8LinearConfig.from_recipe_name(train.fp8)
    all_gather_fp8 = train.fp8 == "tensorwise" and train.fsdp2_sharded and train.tuning.trains_base
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather_fp8, emulate=emulate)
    lora = train.tuning is LORA
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, fqn: eligible(module, fqn, lora))


def eligible(module: nn.Module, fqn: str, lora: bool) -> bool:
    """Whether the linear `module` (named `fqn` in the model) runs in FP8 (see the module doc)."""
    if not isinstance(module, nn.Linear) or ".layers." not in f".{fqn}":
        return False
    if module.in_features % TILE or module.out_features % TILE:
        return False
    return fqn.endswith("base_layer") if lora else True


def converted(model: nn.Module) -> dict[str, int]:
    """The model's linears that run in FP8: name -> weight elements (in_features x out_features)."""
    from torchao.float8.float8_linear import Float8Linear

    return {name: module.in_features * module.out_features for name, module in model.named_modules()
            if isinstance(module, Float8Linear)}


def columns(linears: dict[str, int], full: bool, flops_per_token: float) -> dict:
    """The row's FP8 columns: how many linears ran in FP8, which (block index dropped: "mlp.up_proj", under LoRA
    "mlp.up_proj.base_layer"), and their share of the row's model FLOPs per token (flops_per_token: 6 per weight
    a token for a trained linear, 4 for a frozen LoRA base, whose weight gradient torchao 0.18 computes anyway and
    throws away: run, not counted). MFU stays on the bf16 peak (spec.metrics.mfu)."""
    per_token = (6 if full else 4) * sum(linears.values())
    kinds = sorted({re.sub(r"^.*\.layers\.\d+\.", "", name) for name in linears})
    return {"fp8_linears": len(linears), "fp8_linear_kinds_json": json.dumps(kinds),
            "fp8_flops_frac": per_token / flops_per_token}
