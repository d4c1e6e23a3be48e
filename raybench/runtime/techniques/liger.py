"""Liger kernels: Triton RMSNorm, RoPE, SwiGLU and fused linear + cross-entropy patched into the model (CUDA).

liger-kernel is an optional extra (`raybench[gpu]`), imported only on a worker that asked for it. Liger patches
more than the model instance it is given: it also replaces names in the model type's transformers modeling
module for the whole process (its RMSNorm and MLP classes and its rotary function, at least), so a
later model of that type built in the same process would get Liger's kernels without asking. In a warm pool
actor raybench.runtime.isolation finds those patches, puts the originals back after the trial and has the pool
replace the actors; a fresh process (torchrun, Ray Train) ends with the trial.
"""

from __future__ import annotations

import torch
from torch import nn

from raybench.spec.sweep_spec import TrainSpec

PATCHERS = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2"}


def wanted(train: TrainSpec) -> bool:
    return train.liger


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    # The model is still on the meta device here (build.build_and_wrap materializes it after the techniques):
    # ask for CUDA, not for the parameters' device.
    if not torch.cuda.is_available():
        raise ValueError("train.liger=true needs CUDA GPUs (Triton kernels); on CPU set train.liger: false")
    model_type = model.config.model_type
    if model_type not in PATCHERS:
        raise ValueError(f"train.liger=true supports {', '.join(PATCHERS)} models, not {model_type!r}")
    try:
        import liger_kernel.transformers as liger_transformers
    except ImportError:
        raise ImportError("train.liger=true needs liger-kernel on every worker: pip install 'raybench[gpu]'") \
            from None
    getattr(liger_transformers, PATCHERS[model_type])(model=model)
    return model
