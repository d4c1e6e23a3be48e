"""What one trial may leave behind in a process that runs the next one (a warm pool actor), and undoing it.

Libraries change process-wide state as a side effect: Liger replaces transformers' module-level RMSNorm, MLP and
rotary functions and the causal-LM class's `forward`; DeepSpeed ZeRO-3 replaces `torch.nn.functional.linear`; a
trial may flip TF32 (fp32 precision), SDPA backends or deterministic mode, change dynamo's or inductor's
settings, or set environment variables. `snapshot` records that state before a trial, and keeps recording the
watched modules the trial imports, each as it was when its import finished; `restore` puts every changed item
back and says what had changed, so that the pool can also replace the actors (state no snapshot covers may have
changed with it). docs/executors.md lists the contract.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

# Modules whose top-level names, and the attributes of the classes they define, a library may monkey-patch:
# these, and every model's modeling module (transformers.models.<type>.modeling_<type>, what Liger patches).
WATCHED_MODULES = ("torch", "torch.nn.functional")
# torch's config modules (torch.utils._config_module): read and put back through their own API.
CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")

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


def _watched(module_name: str) -> bool:
    return (module_name in WATCHED_MODULES or module_name in CONFIG_MODULES
            or (module_name.startswith("transformers.models.") and ".modeling_" in module_name))


@dataclass(frozen=True)
class ModuleState:
    names: dict[str, object]  # top-level name -> object
    class_attributes: dict[str, dict[str, object]]  # name of a class the module defines -> its own attributes


def _module_state(module: types.ModuleType) -> ModuleState:
    names = dict(vars(module))
    classes = {name: dict(vars(obj)) for name, obj in names.items()
               if isinstance(obj, type) and obj.__module__ == module.__name__}
    return ModuleState(names, classes)


@dataclass
class ProcessState:
    modules: dict[str, ModuleState]
    configs: dict[str, dict[str, object]]  # config module name -> its settings (get_config_copy)
    flags: dict[str, object]
    environ: dict[str, str]
    recorder: _RecordOnImport = field(repr=False)


def _record(module: types.ModuleType, state: ProcessState) -> None:
    """Add a watched module, as it is now, to `state` (unless it is there already)."""
    name = module.__name__
    if name in CONFIG_MODULES:
        state.configs.setdefault(name, module.get_config_copy())
    else:
        state.modules.setdefault(name, _module_state(module))


class _RecordingLoader(importlib.abc.Loader):
    """Runs a watched module's own loader, then records the module before anyone can patch it."""

    def __init__(self, loader: importlib.abc.Loader, state: ProcessState):
        self.loader, self.state = loader, state

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The module keeps its own loader (source lookups, reloads), not this one.
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _record(module, self.state)


class _RecordOnImport(importlib.abc.MetaPathFinder):
    """While a trial runs, first on sys.meta_path: hands each watched module it imports to a _RecordingLoader.
    A trial imports the modeling module of its model type the first time an actor runs one, and Liger patches
    it right after: recorded only at snapshot, such a patch would go unseen and stay in the actor."""

    def __init__(self, state: ProcessState):
        self.state = state
        self.finding: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if not _watched(fullname) or fullname in self.finding:
            return None
        self.finding.add(fullname)  # the other finders find the spec: this one steps aside meanwhile
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RecordingLoader(spec.loader, self.state)
        return spec


def snapshot() -> ProcessState:
    """Record the process-wide state now; keep recording the watched modules imported until `restore`."""
    state = ProcessState({}, {}, _flags(), dict(os.environ), recorder=None)
    for module in [m for name, m in list(sys.modules.items()) if _watched(name)]:
        _record(module, state)
    state.recorder = _RecordOnImport(state)
    sys.meta_path.insert(0, state.recorder)
    return state


def restore(before: ProcessState, set_for_trial: Collection[str] = ()) -> list[str]:
    """Put back everything that differs from `before`; returns what had changed (empty: nothing), leaving out
    the PRIVATE_ENVIRON variables and those the caller set for the trial (`set_for_trial`)."""
    if before.recorder in sys.meta_path:
        sys.meta_path.remove(before.recorder)
    changed = []
    for name, state in before.modules.items():
        changed += _restore_module(sys.modules.get(name), state)
    for name, settings in before.configs.items():
        changed += _restore_config(name, settings)
    for name, value in before.flags.items():
        if _flags()[name] != value:
            changed.append(name)
            _set_flag(name, value)
    return changed + _restore_environ(before.environ, set_for_trial)


def _added_by_a_patch(owner_name: str, name: str, obj: object) -> bool:
    """A name that appeared in a module during the trial and was not put there by the interpreter or by an
    import: not a dunder (warnings add `__warningregistry__`), nor a submodule bound on its package when first
    imported."""
    if name.startswith("__") and name.endswith("__"):
        return False
    return not (isinstance(obj, types.ModuleType) and obj.__name__ == f"{owner_name}.{name}")


def _restore_attributes(owner, owner_name: str, before: dict[str, object], count_new: bool) -> list[str]:
    """Put `owner`'s own attributes (a module's globals, a class's dict) back to `before`; returns the changed.
    New attributes are removed; `count_new`: they count as changes."""
    changed = []
    now = dict(vars(owner))
    for name, obj in before.items():
        if now.get(name, before) is not obj:  # `before` itself: a sentinel no attribute can hold
            changed.append(f"{owner_name}.{name}")
            setattr(owner, name, obj)
    for name in now.keys() - before.keys():
        if not count_new:
            delattr(owner, name)
        elif _added_by_a_patch(owner_name, name, now[name]):
            changed.append(f"{owner_name}.{name} (new)")
            delattr(owner, name)
    return changed


def _restore_module(module: types.ModuleType | None, before: ModuleState) -> list[str]:
    if module is None:  # removed from sys.modules during the trial: nothing of it to put back
        return []
    changed = _restore_attributes(module, module.__name__, before.names, count_new=True)
    for class_name, attributes in before.class_attributes.items():
        # New class attributes are libraries' caches (transformers keeps one per model class on it): removed, as
        # a fresh process has none, but no reason to replace the group. Patches replace what a class has.
        cls = before.names[class_name]
        changed += _restore_attributes(cls, f"{module.__name__}.{class_name}", attributes, count_new=False)
    return changed


def _restore_config(name: str, before: dict[str, object]) -> list[str]:
    config = sys.modules[name]
    now = config.get_config_copy()
    differing = {key: value for key, value in before.items() if now.get(key) != value}
    config.load_config(differing)
    return [f"{name}.{key}" for key in differing]


def _restore_environ(before: dict[str, str], set_for_trial: Collection[str]) -> list[str]:
    changed = []
    for name in set(os.environ) | set(before):
        if os.environ.get(name) != before.get(name):
            if name not in PRIVATE_ENVIRON and name not in set_for_trial:
                changed.append(f"os.environ[{name}]")
            if name in before:
                os.environ[name] = before[name]
            else:
                os.environ.pop(name)
    return changed
