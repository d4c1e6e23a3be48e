"""What one trial may leave behind in a process that runs the next one (a warm pool actor), and undoing it.

Libraries change process-wide state as a side effect: Liger replaces transformers' module-level RMSNorm, MLP and
rotary functions; DeepSpeed ZeRO-3 replaces `torch.nn.functional.linear`; a trial may flip TF32 (fp32
precision), SDPA backends or deterministic mode, or set environment variables. `snapshot` records that state
before a trial; `restore` puts every changed item back and says what had changed, so that the pool can also
replace the actors (state no snapshot covers may have changed with it). docs/executors.md lists the contract.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from dataclasses import dataclass

import torch

# Modules whose top-level names a library may monkey-patch. Modules not imported yet are skipped (and cannot
# have been patched before being imported).
WATCHED_MODULES = ("torch", "torch.nn.functional", "transformers.models.llama.modeling_llama",
                   "transformers.models.qwen2.modeling_qwen2")


# Environment variables a library sets for its own use, carrying no setting of the trial: put back like the
# others, but no reason to replace the group. Inductor sets this one (an address inside this process) before it
# loads each compiled CPU kernel; counting it made every compiled trial the last of its group.
PRIVATE_ENVIRON = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",)


# Global torch switches that change numerics or kernels, as (object, attribute). fp32 precision is read through
# torch's fp32_precision API only: reading the legacy allow_tf32 / float32_matmul_precision after a model set
# the new one raises.
_SWITCHES = {
    "torch.backends.fp32_precision": (torch.backends, "fp32_precision"),
    "torch.backends.cuda.matmul.fp32_precision": (torch.backends.cuda.matmul, "fp32_precision"),
    "torch.backends.cudnn.fp32_precision": (torch.backends.cudnn, "fp32_precision"),
    "torch.backends.cudnn.conv.fp32_precision": (torch.backends.cudnn.conv, "fp32_precision"),
    "torch.backends.mkldnn.matmul.fp32_precision": (torch.backends.mkldnn.matmul, "fp32_precision"),
}


def _flags() -> dict[str, object]:
    sdp = torch.backends.cuda
    return {
        **{name: getattr(obj, attr) for name, (obj, attr) in _SWITCHES.items()},
        "torch.deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.default_dtype": torch.get_default_dtype(),
        "sdpa.flash": sdp.flash_sdp_enabled(), "sdpa.mem_efficient": sdp.mem_efficient_sdp_enabled(),
        "sdpa.math": sdp.math_sdp_enabled(), "sdpa.cudnn": sdp.cudnn_sdp_enabled(),
    }


def _set_flag(name: str, value) -> None:
    if name in _SWITCHES:
        obj, attr = _SWITCHES[name]
        setattr(obj, attr, value)
        return
    setters = {
        "torch.deterministic_algorithms": torch.use_deterministic_algorithms,
        "torch.default_dtype": torch.set_default_dtype,
        "sdpa.flash": torch.backends.cuda.enable_flash_sdp,
        "sdpa.mem_efficient": torch.backends.cuda.enable_mem_efficient_sdp,
        "sdpa.math": torch.backends.cuda.enable_math_sdp, "sdpa.cudnn": torch.backends.cuda.enable_cudnn_sdp,
    }
    setters[name](value)


@dataclass(frozen=True)
class ProcessState:
    attributes: dict[str, dict[str, object]]  # module name -> {top-level name: object}
    flags: dict[str, object]
    environ: dict[str, str]


def snapshot() -> ProcessState:
    attributes = {name: dict(vars(sys.modules[name])) for name in WATCHED_MODULES if name in sys.modules}
    return ProcessState(attributes, _flags(), dict(os.environ))


def restore(before: ProcessState, set_for_trial: Collection[str] = ()) -> list[str]:
    """Put back everything that differs from `before`; returns what had changed (empty: nothing), leaving out
    the PRIVATE_ENVIRON variables and those the caller set for the trial (`set_for_trial`)."""
    changed = []
    for module_name, names in before.attributes.items():
        module = sys.modules[module_name]
        now = vars(module)
        for name, obj in names.items():
            if now.get(name) is not obj:
                changed.append(f"{module_name}.{name}")
                setattr(module, name, obj)
    for name, value in before.flags.items():
        if _flags()[name] != value:
            changed.append(name)
            _set_flag(name, value)
    for name in set(os.environ) | set(before.environ):
        if os.environ.get(name) != before.environ.get(name):
            if name not in PRIVATE_ENVIRON and name not in set_for_trial:
                changed.append(f"os.environ[{name}]")
            if name in before.environ:
                os.environ[name] = before.environ[name]
            else:
                os.environ.pop(name)
    return changed
