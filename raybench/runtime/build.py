"""Build a rank's model from its trial, in one place: the causal LM on the meta device (`build_meta`: a preset
with random weights, or a local Hugging Face directory), the techniques in their one order (`TECHNIQUES`,
`prepare_model`), then the trial's strategy, which calls back to give the model its values (`fill`) before or
after its wrap (`build_and_wrap`, whose `Built` the worker measures).

Weights load from safetensors only unless the sweep sets model.allow_pickle; nothing is ever downloaded.
"""

from __future__ import annotations

import os

# Never reach for a model hub while building: models and tokenizers come from local directories only, whoever
# builds them (a rank, the rehearsal).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from raybench.runtime import strategies, weights  # noqa: E402
from raybench.runtime.materialize import base_state, materialize  # noqa: E402
from raybench.runtime.model import count_params, with_layers  # noqa: E402
from raybench.runtime.strategies import RankContext  # noqa: E402
from raybench.runtime.techniques import (  # noqa: E402
    activation_checkpointing, chunked_loss, compile, fp8, liger, lora, qlora)
from raybench.spec import options  # noqa: E402
from raybench.spec.load import check_model_dir  # noqa: E402
from raybench.spec.payload import TrialPayload  # noqa: E402
from raybench.spec.presets import PRESETS, ModelShape  # noqa: E402
from raybench.spec.sweep_spec import ModelSpec, TrainSpec  # noqa: E402

log = logging.getLogger(__name__)


class _OptionalKernelNoise(logging.Filter):
    """transformers imports torchao (its quantizers) when it builds a model: torchao then warns that its optional
    C++ kernels built for another Python or GPU (mxfp8, cutlass sm90a) do not load, and torch that torchao's enums
    need no registering. Neither is raybench's to act on (its FP8 runs on torch's scaled matmul), and on every
    rehearsal they bury the table: dropped here, any other warning of those loggers kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Failed to load ") or "is an Enum subclass and is now natively supported" in text)


for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(_OptionalKernelNoise())


@dataclass(frozen=True)
class WeightsSource:
    """Where a meta-built model's values come from (see `raybench.runtime.materialize`)."""

    seed: int
    weights_dir: str | None = None  # a model directory (safetensors); None: random init
    cache_key: str | None = None  # the warm pool's in-memory cache key; None: no cache
    cache_gib: float = 0.0
    state: dict | None = None  # whole tensors already read into memory (a pickle-only directory)
    missing_weights: str = "error"  # model.missing_weights: base weights the checkpoint lacks


def build_meta(spec: ModelSpec, seed: int, local_copy: str = "never", cache_gib: float = 0.0,
               shape: ModelShape | None = None, layers: int | None = None) -> tuple[nn.Module, WeightsSource, dict]:
    """The causal LM's architecture in fp32 on the meta device (nothing allocated), where its values will come
    from, and {"weights_cache": "hit" | "miss" | None, "weights_copy_s": seconds copying or None}.

    local_copy (auto | always | never) reads a model directory from a node-local copy; cache_gib > 0 keeps
    whole models' weights in this process's memory for the next trial on the same model (warm pool actors).
    shape: build this architecture, random-initialized, instead of the spec's (a worker's warm-up miniature).
    layers: build only this many decoder blocks (the rehearsal's shallow models; see `with_layers`).
    """
    info = {"weights_cache": None, "weights_copy_s": None}
    path = spec.path if shape is None else None
    if path is not None:
        problems = check_model_dir(path, spec.allow_pickle)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
        if weights.wants_copy(path, local_copy):
            t0 = time.perf_counter()
            path = str(weights.node_local_copy(path)[0])
            info["weights_copy_s"] = time.perf_counter() - t0
    from transformers import AutoModelForCausalLM  # transformers: imported by the ranks only

    with torch.device("meta"):
        config = _hf_config(spec, path, shape)
        model = AutoModelForCausalLM.from_config(config if layers is None else with_layers(config, layers),
                                                 dtype=torch.float32,
                                                 attn_implementation=spec.attn_implementation,
                                                 trust_remote_code=spec.trust_remote_code)
    key = None
    if cache_gib > 0 and shape is None:
        key = f"preset:{spec.preset}:{seed}" if path is None else f"dir:{weights.model_key(Path(path))}"
        key += f":{spec.attn_implementation}"
    state = None
    if path is not None and not any(Path(path).glob("*.safetensors")):  # allow_pickle: the old, whole read
        log.warning("model.allow_pickle is set: pickle weights in %s can run arbitrary code when loaded", path)
        state = _pickled_state(spec, path)
    return model, WeightsSource(seed, path if state is None else None, key, cache_gib, state,
                                spec.missing_weights), info


def fill(model: nn.Module, device: torch.device, source: WeightsSource, info: dict, whole: bool) -> None:
    """Materialize `model` on `device`: whole, or (after a sharding wrap) each rank's own shards.

    The warm pool's weights cache holds whole tensors: a whole build fills it (within its budget); a sharded
    build takes its shards from it on a hit, and never fills it, which would mean holding whole tensors."""
    key = _cache_key(source, model)
    cached = weights.STATE_CACHE.get(key) if key else None
    if key:
        info["weights_cache"] = "hit" if cached is not None else "miss"
    materialize(model, device, source.seed, source.weights_dir, cached if cached is not None else source.state,
                source.missing_weights)
    if whole and key and cached is None:
        budget = int(source.cache_gib * 2**30)
        # Only copy what the cache can keep: a model over the budget (a 1B model in fp32 over the default 4 GiB)
        # would cost every trial a host copy of its weights, counted in its build time and peak RSS.
        if sum(t.numel() * t.element_size() for t in model.parameters()) <= budget:
            weights.STATE_CACHE.put(key, base_state(model), budget)


def _cache_key(source: WeightsSource, model: nn.Module) -> str | None:
    """The weights cache key of this build: the cache holds tensors in the dtypes they were built in, so a LoRA
    base stored in bf16 must neither hand its rounded values to an fp32 trial of the same model nor take them."""
    if source.cache_key is None:
        return None
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    return f"{source.cache_key}:{'+'.join(dtypes)}"


def build_model(spec: ModelSpec, device: torch.device, seed: int, local_copy: str = "never",
                cache_gib: float = 0.0) -> tuple[nn.Module, dict]:
    """The whole causal LM in fp32 on `device` (the same values on every rank and for every strategy), and
    where its weights came from (see build_meta)."""
    model, source, info = build_meta(spec, seed, local_copy, cache_gib)
    if device.type != "meta":
        fill(model, device, source, info, whole=True)
    return model, info



def _hf_config(spec: ModelSpec, path: str | None, shape: ModelShape | None = None):
    from transformers import AutoConfig

    if path is None:
        shape = shape or PRESETS[spec.preset]
        return AutoConfig.for_model(shape.model_type, **shape.hf_config_kwargs(), use_cache=False)
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    config.use_cache = False
    return config



def _pickled_state(spec: ModelSpec, path: str) -> dict:
    """Whole tensors of a pickle-only model directory (model.allow_pickle), by checkpoint key."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                 use_safetensors=None, trust_remote_code=spec.trust_remote_code)
    return base_state(model)


# The one order of model transformations that composes: Liger → chunked loss → 4-bit base (QLoRA) → LoRA → FP8 → AC
# → compile. Liger, the chunked loss (the causal LM's forward, where Liger has not replaced it) and quantization
# first: they swap the model's own modules and forwards, which LoRA then wraps (PEFT
# puts adapters around whatever Linear/Linear4bit it finds). FP8 after LoRA: it swaps the base linears PEFT wrapped
# (base_layer) and leaves the adapters alone. LoRA and FP8 before checkpointing: adapters must exist
# before the blocks are wrapped, so that they are inside each block's checkpoint and compiled graph.
# Checkpointing before compile: the compiled graph then contains the checkpoint boundary and can plan the
# recomputation itself (not under TP, where torch 2.13 cannot: compile.compiled_region). Sharding/wrapping (the
# strategy) comes last, in build_and_wrap, because it must see the final modules and parameters: anything swapped in
# later would escape sharding and gradient reduction.
# An option with a technique of its own (spec/options.py) places it in this order itself (`after`).
_ORDER = (liger, chunked_loss, qlora, lora, fp8, activation_checkpointing, compile)
TECHNIQUES = tuple(importlib.import_module(f"raybench.runtime.techniques.{name}")
                   for name in options.placed_techniques([t.__name__.rpartition(".")[2] for t in _ORDER]))


def prepare_model(model: nn.Module, train: TrainSpec, techniques: tuple = TECHNIQUES) -> nn.Module:
    """Apply every technique the trial asks for, in TECHNIQUES order (each: wanted(train), apply(model, train));
    the rehearsal passes its own list, in the same order."""
    for technique in techniques:
        if technique.wanted(train):
            model = technique.apply(model, train)
    return model


@dataclass(frozen=True)
class Built:
    trainable: strategies.Trainable
    params_total: int  # before sharding
    params_trainable: int
    weights_info: dict  # weights_cache, weights_copy_s
    model_build_s: float  # meta build, techniques and giving the model its values
    wrap_s: float  # the strategy's own setup
    fp8_linears: dict[str, int]  # train.fp8: the linears converted (fp8.converted); empty when off


def build_and_wrap(payload: TrialPayload, ctx: RankContext, shape: ModelShape | None = None) -> Built:
    """Architecture on the meta device → techniques → the strategy, which calls `materialize` to give the model
    its values: whole before it wraps (ddp, ZeRO-1/2), or after a sharding wrap (fsdp2, tp, tp_fsdp2) or ZeRO-3's
    partitioning only this rank's shards. shape: another architecture, random-initialized (the warm-up)."""
    train = payload.config.train
    t0 = time.perf_counter()
    model, source, weights_info = build_meta(payload.config.model, train.seed,
                                             local_copy=payload.caches.weights_local_copy,
                                             cache_gib=payload.weights_cache_gib, shape=shape)
    if train.tuning.quantized_base:  # bitsandbytes quantizes real weights: the (ddp-only) base is whole first
        fill(model, ctx.device, source, weights_info, whole=True)
        torch.manual_seed(train.seed)  # PEFT's adapter init then draws the same numbers on every rank
    model = prepare_model(model, train)
    params_total, params_trainable = count_params(model)
    fp8_linears = fp8.converted(model) if fp8.wanted(train) else {}
    materialize_s = []

    def materialize(whole: bool) -> None:
        if not train.tuning.quantized_base:
            t_fill = time.perf_counter()
            fill(model, ctx.device, source, weights_info, whole)
            materialize_s.append(time.perf_counter() - t_fill)

    t_wrap = time.perf_counter()
    trainable = strategies.setup(train.strategy, model, train, ctx, materialize)
    wrap_s = time.perf_counter() - t_wrap - sum(materialize_s)
    return Built(trainable, params_total, params_trainable, weights_info, t_wrap - t0 + sum(materialize_s), wrap_s,
                 fp8_linears)
