"""The trial as the trace builds it: the TrainSpec it runs (`traced_train`) and what that changes from the trial,
the attention it traces (`traced_model_spec`: flex_attention as sdpa), the model with its techniques (Liger's
reference operators, FP8 without the tensor-core check), its synthetic batches, and DDP built with the buckets of
its steady state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from raybench.runtime.build import TECHNIQUES, build_meta, prepare_model
from raybench.runtime.techniques import activation_checkpointing, fp8, liger_reference
from raybench.spec.presets import ModelShape
from raybench.spec.sweep_spec import ModelSpec, TrainSpec, TrialConfig

COMPILE_NOTE = "compile traced eager"
LIGER_NOTE = "liger traced with reference operators, one per Triton kernel"
COMPILED_ACTIVATIONS_NOTE = "compile traced eager, its blocks' saved activations from torch.compile's partitioner"
FLEX_NOTE = "flex_attention traced as sdpa: causal attention on whole rows, its block mask's skipped tiles unpriced"


def traced_config(config: TrialConfig) -> TrialConfig:
    """The trial as the trace runs it (see traced_train, traced_model_spec): trials with equal traced configs
    trace the same step."""
    train, _ = traced_train(config.train, config.resources.gpus_per_worker > 0)
    return config.model_copy(update={"train": train, "model": traced_model_spec(config.model)})


def traced_model_spec(model: ModelSpec) -> ModelSpec:
    """The model as the trace builds it: flex_attention as sdpa. The trace runs on CPU fake tensors, and torch's
    FlexAttention has no CPU backward (nor can its kernel be compiled for fake tensors); sdpa does the same
    attention's work on the trace's rows (synthetic: one causal sequence a row, so no block mask to skip tiles
    by), and keeps the same tensors for backward (q, k, v, output, logsumexp)."""
    if model.attn_implementation != "flex_attention":
        return model
    return model.model_copy(update={"attn_implementation": "sdpa"})


def model_notes(model: ModelSpec) -> list[str]:
    """What the trace changes from the trial's model (traced_model_spec), as notes on its row."""
    return [FLEX_NOTE] if model.attn_implementation == "flex_attention" else []


def traced_train(train: TrainSpec, on_gpu: bool) -> tuple[TrainSpec, list[str]]:
    """The TrainSpec the trace runs, and what it changes from the trial (each change is reported per row).

    The trace runs on CPU fake tensors, so it runs the GPU worker's choices explicitly: AdamW's fused kernel
    (what "adamw" picks on CUDA). torch.compile is not traced (its graphs would be compiled for CPU): compiled
    trials are traced eager; their step time accounts for fusion (predict_step_time) and their activations for
    what compiled blocks keep (compiled_block_saving_gib). Liger's Triton kernels are traced
    as reference operators with the same inputs, outputs and saved tensors (`build_traced`).
    """
    changes = {}
    notes = []
    if on_gpu and train.optimizer == "adamw":
        changes["optimizer"] = "adamw_fused"
    if train.liger:
        notes.append(LIGER_NOTE)
    if train.compile:
        changes["compile"] = False
        notes.append(COMPILE_NOTE)
    return (train.model_copy(update=changes) if changes else train), notes


class _Fp8Traced:
    """train.fp8 as the trace applies it: the same linears converted to torchao's Float8Linear, without the
    worker's check for FP8 tensor cores (the trace runs on a fake GPU; the plan has refused CPU trials)."""

    wanted = staticmethod(fp8.wanted)
    apply = staticmethod(fp8.convert)


# A technique whose module says TRACED = False changes nothing a fake-tensor trace can see (what it does happens
# on a real device), and the rehearsal prices it from the step as traced without it (rehearsal.py).
TRACED_TECHNIQUES = tuple(_Fp8Traced if technique is fp8 else technique for technique in TECHNIQUES
                          if getattr(technique, "TRACED", True))


def build_traced(config: TrialConfig, train: TrainSpec,
                 kinds: tuple[bool, ...] | None = None) -> tuple[nn.Module, str, dict]:
    """build_meta and the techniques of `train` (a traced TrainSpec), with Liger's reference operators where
    the trial asks for Liger: they come first, as Liger does in build.TECHNIQUES.

    kinds: build a model of len(kinds) decoder blocks instead, checkpointing those marked True (depth.py)."""
    model, source, info = build_meta(traced_model_spec(config.model), train.seed,
                                     layers=None if kinds is None else len(kinds))
    if train.liger:
        model = liger_reference.apply(model)
        # The reference operators stand in for the kernels, the fused loss included.
        train = train.model_copy(update={"liger": False, "loss": "full"})
    if kinds is None:
        return prepare_model(model, train, TRACED_TECHNIQUES), source, info
    # The techniques before checkpointing, then checkpointing where `kinds` says (it comes after them).
    model = prepare_model(model, train.model_copy(update={"ac_ratio": "0"}), TRACED_TECHNIQUES)
    return activation_checkpointing.checkpoint(model, train, [i for i, ac in enumerate(kinds) if ac]), source, info


def unwrapped_model(config: TrialConfig, layers: int | None = None) -> tuple[nn.Module, TrainSpec]:
    """The trial's model with its techniques (no checkpointing, no compile) on the meta device, its parameters
    in the dtype its strategy computes with, and the TrainSpec it was built with. FSDP2's mixed-precision
    policy casts them to bf16 before each forward (fsdp2.shard); ddp and tp keep them fp32 (a LoRA base in
    train.lora.base_dtype, cast by the LoRA technique itself) and run forward under autocast
    (`strategies.autocast_for`). Cast on meta: fake storage cannot be swapped in place afterwards.

    layers: build only this many decoder blocks (for what one block runs, whatever the model's depth)."""
    train = config.train.model_copy(update={"ac_ratio": "0", "compile": False})
    model, _, _ = build_traced(config, train, None if layers is None else (False,) * layers)
    if train.precision == "bf16" and train.fsdp2_sharded:
        model.to(torch.bfloat16)
    return model, train


def liger_rope(config: TrialConfig, shape: ModelShape):
    """The context a Liger trial's forward runs in: Liger's rotary kernel in place of transformers' function."""
    if not config.train.liger:
        return contextlib.nullcontext()
    return liger_reference.rope_patched(shape.model_type)


def fake_batches(train: TrainSpec, vocab_size: int, device: torch.device) -> Iterator[dict]:
    """Packed synthetic micro-batches (no padding: input_ids and labels), as the worker's data would be."""
    while True:
        ids = torch.randint(0, vocab_size, (train.micro_batch, train.seq_len), device=device)
        yield {"input_ids": ids, "labels": ids}


# DDP all-reduces its gradients in buckets of at most 25 MiB (the first 1 MiB) as backward makes them, from its
# second iteration on; its first, the one the trace runs, all-reduces every gradient at once after backward: torch
# starts with one bucket and rebuilds the buckets in the order the first backward made the gradients.
DDP_BUCKET_CAP_BYTES = 25 * 2**20


def steady_state_ddp_buckets(model: nn.Module):
    """Build DDP with the buckets it rebuilds to: torch's own assignment (`_compute_bucket_assignment_by_size`,
    the rebuild's) over the trainable parameters in reverse order of definition, the order backward makes their
    gradients in (a norm's weight may land in the neighbouring bucket), handed to DDP as per-bucket limits in
    definition order, the order DDP packs its first buckets in."""
    from raybench.runtime.strategies import ddp

    ready = [p for p in model.parameters() if p.requires_grad][::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        ready, [dist._DEFAULT_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES], [False] * len(ready))
    sizes = [sum(ready[i].numel() * ready[i].element_size() for i in bucket) for bucket in buckets]
    # DDP closes a bucket once it holds its limit: a limit half a byte under each size closes it on its last tensor.
    limits_mib = [(size - 0.5) / 2**20 for size in reversed(sizes)]
    return mock.patch.object(ddp, "DistributedDataParallel",
                             partial(ddp.DistributedDataParallel, bucket_cap_mb_list=limits_mib))
