"""raybench.runtime.isolation on the real modules: what a trial changes process-wide is found and put back."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from raybench.runtime import isolation


def test_patched_names_flags_and_environment_are_restored():
    linear, rms_norm = F.linear, modeling_llama.LlamaRMSNorm
    precision = torch.backends.cuda.matmul.fp32_precision
    before = isolation.snapshot()
    # What DeepSpeed ZeRO-3 and Liger do to the process, and what a model's code may do to torch's switches.
    F.linear = lambda *args, **kwargs: linear(*args, **kwargs)
    modeling_llama.LlamaRMSNorm = type("PatchedRMSNorm", (torch.nn.Module,), {})
    torch.backends.cuda.matmul.fp32_precision = "tf32" if precision != "tf32" else "ieee"  # TF32 on
    os.environ["NCCL_RAYBENCH_TEST"] = "1"
    changed = isolation.restore(before)
    assert F.linear is linear and modeling_llama.LlamaRMSNorm is rms_norm
    assert torch.backends.cuda.matmul.fp32_precision == precision and "NCCL_RAYBENCH_TEST" not in os.environ
    assert set(changed) == {"torch.nn.functional.linear", "transformers.models.llama.modeling_llama.LlamaRMSNorm",
                            "torch.backends.cuda.matmul.fp32_precision", "os.environ[NCCL_RAYBENCH_TEST]"}


def test_nothing_changed_reports_nothing():
    before = isolation.snapshot()
    torch.ones(3) @ torch.ones(3)  # ordinary work touches no process-wide state
    assert isolation.restore(before) == []


def test_a_compiled_cpu_kernel_changes_nothing_that_counts():
    os.environ.pop("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", None)  # as in a process that compiled nothing yet
    before = isolation.snapshot()
    # Loading the kernel sets inductor's own pointer variable: put back, not a reason to replace a warm group.
    torch.compile(lambda x: x.sin() + 1)(torch.ones(4))
    assert "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR" in os.environ
    assert isolation.restore(before) == []
    assert "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR" not in os.environ
