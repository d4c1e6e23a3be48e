"""Give a model built on the meta device real values, on each rank only for the part of each tensor it holds.

Every strategy builds the architecture on the meta device and applies the techniques there. Sharding
strategies (fsdp2, tp, tp_fsdp2) then wrap it, still on meta, so that `materialize` allocates and fills only
each rank's own shards; DeepSpeed ZeRO-3 turns each parameter into a partitioned one first (each rank
allocating its own flat range of it, strategies/deepspeed.py), which `materialize` then fills. ddp and
ZeRO-1/2 hold whole parameters by design and materialize before wrapping.

Values do not depend on the strategy or the world size:
- random init (presets): each parameter is drawn in blocks of rows, each block from its own generator seeded
  by (seed, parameter name, block index), so a rank draws only the row blocks its shard overlaps and the
  concatenation of all blocks is the same tensor every strategy would build whole. Values are drawn in fp32 and
  rounded into a 16-bit tensor (a LoRA base in bf16), as a cast of the fp32 model would round them. The
  distributions are Hugging Face's `_init_weights` for Llama/Qwen2 (normal(0, initializer_range) for linear and
  embedding weights, ones for norms, zeros for biases) and PEFT's for LoRA (A kaiming-uniform, B zeros);
- real weights (a model directory): torch.distributed.checkpoint reads the safetensors files with its
  Hugging Face reader, each rank only the slices of its own shards (`safe_open(...).get_slice`), so a node holds
  about one copy of the weights in all, never one per rank (docs/model-build.md measures both ways). A ZeRO-3
  partition, a flat range and no tensor region, is read as the rows that cover it, with `get_slice` directly.
  A base weight the checkpoint lacks is an error (a truncated or mismatched checkpoint would otherwise train
  from random values unnoticed) unless model.missing_weights is `random`; tensors raybench adds itself (LoRA
  adapters) are never in a checkpoint and are always drawn.
Buffers (rotary frequencies) are recomputed by the model's own `_init_weights`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed
from torch import nn
from torch.distributed.tensor import DTensor

# Elements drawn per generator (whole rows): large enough that drawing stays fast, small enough that a rank
# never holds more than 16 MiB (fp32) beyond its shard: a 152064 x 8192 embedding is drawn 512 rows at a time.
BLOCK_ELEMENTS = 1 << 22
# Wrappers that add a path component to parameter names but not to checkpoint keys.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# Parameter name parts of the tensors raybench adds to a model (PEFT's LoRA adapters): no checkpoint has them.
_ADDED_PARTS = (".lora_",)
# Missing base weights named in the error; the count gives the rest.
_NAMED_MISSING = 5


def materialize(model: nn.Module, device: torch.device, seed: int, weights_dir: str | None = None,
                state: dict[str, torch.Tensor] | None = None, missing_weights: str = "error") -> None:
    """Allocate the model's (local) tensors on `device` and fill them: from `state` (whole tensors by checkpoint
    key), else from the safetensors in `weights_dir`; whatever neither holds (LoRA adapters, presets) is random.

    missing_weights: "error" raises when a checkpoint (weights_dir or state) lacks a base weight of the model;
    "random" draws it like a preset's."""
    to_empty_keeping_ties(model, device)
    with torch.no_grad():
        if state is not None:
            loaded = _copy_state(model, state)
        else:
            loaded = _load_safetensors(model, weights_dir) if weights_dir else set()
        if (weights_dir or state is not None) and missing_weights == "error":
            _refuse_missing(model, loaded, weights_dir)
        std = _hf_model(model).config.initializer_range
        seen = set()
        for name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                full_name = f"{name}.{pname}" if name else pname
                if id(param) not in seen and _checkpoint_key(full_name) not in loaded:
                    _init_param(full_name, module, pname, param, std, seed)
                seen.add(id(param))  # a tied head is the embedding: filled once
            if "RotaryEmbedding" in type(module).__name__:
                _hf_model(model)._init_weights(module)


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`Module.to_empty`, keeping shared parameters shared: it gives each module its own new Parameter, which
    would untie a tied output head from the embedding (a model with a separate head of its own values)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, pname))
    model.to_empty(device=device)
    for (first, first_name), *others in (h for h in holders.values() if len(h) > 1):
        for module, pname in others:
            module._parameters[pname] = first._parameters[first_name]


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of a whole (unsharded) model's checkpoint tensors, by checkpoint key (no adapters)."""
    return {_checkpoint_key(name): t.detach().to("cpu", copy=True) for name, t in _named_tensors(model)
            if ".lora_" not in name}


def missing_base_weights(model: nn.Module, loaded: set[str]) -> list[str]:
    """Checkpoint keys of the model's base weights that were not loaded (adapters raybench adds excluded)."""
    return sorted({_checkpoint_key(name) for name, _ in _named_tensors(model)
                   if not any(part in name for part in _ADDED_PARTS)} - loaded)


def _refuse_missing(model: nn.Module, loaded: set[str], weights_dir: str | None) -> None:
    missing = missing_base_weights(model, loaded)
    if not missing:
        return
    where = f"the safetensors files in {weights_dir}" if weights_dir else "the model directory's weights"
    named = ", ".join(missing[:_NAMED_MISSING]) + (", ..." if len(missing) > _NAMED_MISSING else "")
    raise ValueError(
        f"model.path: {len(missing)} base weight(s) of the model are missing from {where} ({named}); they would "
        "train from random values. Fix: point model.path at a complete checkpoint of this architecture, or set "
        "model.missing_weights: random to initialize missing weights randomly on purpose")


def _hf_model(model: nn.Module):
    """The Hugging Face PreTrainedModel inside (PEFT wraps it)."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def _init_param(full_name: str, module: nn.Module, pname: str, param: torch.Tensor, std: float, seed: int) -> None:
    """Fill one parameter's local part with its rule's values (see the module docstring)."""
    kind = type(module).__name__
    shape = _global_shape(param)
    with _part(param) as (local, offset):
        if pname == "bias" or ".lora_B." in f".{full_name}":
            local.zero_()
        elif "Norm" in kind:
            local.fill_(1.0)
        elif ".lora_A." in f".{full_name}":
            bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)), PEFT's default for A
            _draw(local, offset, shape, full_name, seed, lambda t, g: t.uniform_(-bound, bound, generator=g))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            _draw(local, offset, shape, full_name, seed, lambda t, g: t.normal_(0.0, std, generator=g))
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                _fill_row(local, offset, module.padding_idx, 0.0)
        else:
            raise ValueError(f"no initialization rule for parameter {full_name} of {kind}; raybench initializes "
                             "Llama/Qwen2-style models (linear, embedding, norm, LoRA)")


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _is_zero3(param: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: this rank holds a flat range of it, `ds_tensor` (strategies/deepspeed.py)."""
    return hasattr(param, "ds_tensor")


def _global_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape if _is_zero3(param) else param.shape)


def _region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset in the global tensor) of this rank's part of a plain tensor or DTensor."""
    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.dim()
    # DTensor's own placement arithmetic (private; the torch pin keeps it stable, tests/unit cover it).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@contextlib.contextmanager
def _part(param: torch.Tensor) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
    """This rank's part of `param` to fill in place, as a block of the global tensor, and the block's offset.

    A ZeRO-3 parameter's part is a range of the flattened tensor (DeepSpeed's layout: rank r holds elements
    [r * n, (r + 1) * n) of the tensor padded to a multiple of the world size, n = `ds_tensor.numel()`).
    It is filled through the whole rows that cover that range, in fp32 like every other build (a bf16
    partition then gets the fp32 values rounded, as a cast of a whole build would), then copied in.
    """
    if not _is_zero3(param):
        yield _local(param), _region(param)[1]
        return
    shape, partition = _global_shape(param), param.ds_tensor
    numel, row = math.prod(shape), math.prod(shape[1:])
    start = min(param.ds_zero_partition_rank * partition.numel(), numel)
    end = min(start + partition.numel(), numel)
    first, last = start // row, -(-end // row)
    rows = torch.empty((last - first, *shape[1:]), dtype=torch.float32, device=partition.device)
    yield rows, (first,) + (0,) * (len(shape) - 1)
    partition[:end - start].copy_(rows.view(-1)[start - first * row:end - first * row])


def _draw(local: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], name: str, seed: int,
          fill) -> None:
    """Random values for the block `local` of a tensor of `shape` at `offset`, drawn block of rows by block
    (see the module docstring)."""
    if local.numel() == 0:
        return
    row_elements = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_ELEMENTS // row_elements)
    first, last = offset[0], offset[0] + local.shape[0]
    columns = tuple(slice(o, o + s) for o, s in zip(offset[1:], local.shape[1:]))
    for block in range(first // rows_per_block, (last - 1) // rows_per_block + 1):
        start = block * rows_per_block
        rows = min(rows_per_block, shape[0] - start)
        # Drawn in fp32 whatever the destination's dtype: a 16-bit tensor (a LoRA base in bf16) then holds the
        # fp32 build's values rounded, the same values as a cast of the fp32 model.
        values = torch.empty((rows, *shape[1:]), dtype=torch.float32, device=local.device)
        fill(values, _generator(seed, name, block, local.device))
        lo, hi = max(first, start), min(last, start + rows)
        local[lo - first:hi - first].copy_(values[(slice(lo - start, hi - start), *columns)])


def _fill_row(local: torch.Tensor, offset: tuple[int, ...], row: int, value: float) -> None:
    if offset[0] <= row < offset[0] + local.shape[0]:
        local[row - offset[0]].fill_(value)


def _generator(seed: int, name: str, block: int, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{_checkpoint_key(name)}/{block}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _checkpoint_key(name: str) -> str:
    """A parameter's name as a Hugging Face checkpoint spells it: no wrapper or PEFT path components."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _load_safetensors(model: nn.Module, weights_dir: str) -> set[str]:
    """Read every tensor the checkpoint has into the model's (local) tensors; returns the keys read.

    torch.distributed.checkpoint plans the reads across ranks and reads each rank's slices only.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = HuggingFaceStorageReader(str(Path(weights_dir)))
    stored = set(reader.read_metadata().state_dict_metadata)
    targets, zero3 = {}, {}
    for name, tensor in _named_tensors(model):
        key = _checkpoint_key(name)
        if key in stored:
            (zero3 if _is_zero3(tensor) else targets)[key] = tensor
    if targets:
        dcp.load(targets, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=False),
                 no_dist=not torch.distributed.is_initialized())  # one process (a plain build_model) reads alone
    if zero3:
        _read_rows(zero3, weights_dir)
    return set(targets) | set(zero3)


def _read_rows(params: dict[str, torch.Tensor], weights_dir: str) -> None:
    """Read the rows that cover each ZeRO-3 partition straight from the safetensors files (a flat range is no
    tensor region torch.distributed.checkpoint can plan); `get_slice` reads those rows only."""
    from safetensors import safe_open

    for path in sorted(Path(weights_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as stored:
            for key in stored.keys():
                if key in params:
                    with _part(params[key]) as (local, offset):
                        local.copy_(stored.get_slice(key)[offset[0]:offset[0] + local.shape[0]])


def _copy_state(model: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """Copy each rank's region of the whole tensors in `state` into the model; returns the keys copied."""
    copied = set()
    for name, param in _named_tensors(model):
        key = _checkpoint_key(name)
        if key in state:
            with _part(param) as (local, offset):
                local.copy_(state[key][_block(offset, local.shape)])
            copied.add(key)
    return copied


def _block(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:  # a tied head is the embedding: read it once
            seen.add(id(param))
            yield name, param
