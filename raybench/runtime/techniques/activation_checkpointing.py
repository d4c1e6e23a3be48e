"""Layer-level selective activation checkpointing (sAC): wrap the decoder blocks the plan chose (plan.py's
`checkpointed_blocks` places them) with non-reentrant checkpointing, whole-block or op-level.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from raybench.runtime.model import decoder_blocks
from raybench.spec.sac import checkpointed_blocks
from raybench.spec.sweep_spec import TrainSpec


def wanted(train: TrainSpec) -> bool:
    return Fraction(train.ac_ratio) > 0


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    """Wrap the blocks the plan chose (the model's ModuleList, modified in place) with non-reentrant
    checkpointing. ac_mode "block" recomputes a whole block in backward; "op" recomputes only what its policy
    does not save (`policy_context_fn`)."""
    return checkpoint(model, train, checkpointed_blocks(Fraction(train.ac_ratio), len(decoder_blocks(model))))


def checkpoint(model: nn.Module, train: TrainSpec, indices: list[int]) -> nn.Module:
    """Wrap the decoder blocks at `indices` as `apply` does (the rehearsal's shallow models choose their own)."""
    blocks = decoder_blocks(model)
    extra = {"context_fn": policy_context_fn(train)} if train.ac_mode == "op" else {}
    for i in indices:
        # Non-reentrant checkpointing composes with FSDP2, DDP and torch.compile; the reentrant variant does not.
        blocks[i] = checkpoint_wrapper(blocks[i], **extra)
    return model


def _saved_ops() -> set:
    """Ops whose outputs op-level AC keeps: matmuls, attention kernels and reduce-scatters (torchtitan's list).

    These are the expensive ops to recompute; everything else (norms, activations, elementwise) is cheap
    compute on large tensors and is recomputed instead.
    """
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.max.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops._c10d_functional.reduce_scatter_tensor.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        ops.add(aten._scaled_dot_product_cudnn_attention.default)
    return ops


def policy_context_fn(train: TrainSpec, on_saved: Callable[[torch.Tensor], None] | None = None) -> Callable:
    """The `context_fn` of an op-level checkpoint (ac_mode "op"): fresh (forward, recompute) contexts for each
    checkpointed call, with the policy `train.ac_saved_ops` lists, else torchtitan's (`op_policy`).

    on_saved: called with every output the forward keeps. The checkpoint holds those in its own cache, where
    saved-tensor hooks do not see them; the rehearsal counts them this way."""
    make_policy = functools.partial(listed_policy, train.ac_saved_ops) if train.ac_saved_ops else op_policy

    def contexts():
        policy = make_policy()
        if on_saved is not None:
            policy = _reporting(policy, on_saved)
        return create_selective_checkpoint_contexts(policy)

    return contexts


def _reporting(policy: Callable, on_saved: Callable[[torch.Tensor], None]) -> Callable:
    def reporting(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for out in pytree.tree_leaves(ctx.op_output):
                if isinstance(out, torch.Tensor):
                    on_saved(out)
        return decision

    return reporting


def op_policy() -> Callable:
    """A fresh policy for one checkpointed call: torchtitan's "op" SAC policy.

    Every second matmul is recomputed rather than saved, as torchtitan does, so that the saved activations
    shrink by about half of the matmul outputs while the most expensive kernels (attention) are never rerun.
    The mm counters live per call and per pass so the forward and the recompute make the same decisions.
    """
    saved = _saved_ops()
    mm_counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            mm_counts[key] += 1
            if mm_counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# SDPA's kernels differ by device and backend (flash, efficient, cuDNN, the CPU one); a policy names them as one.
_SDPA = re.compile(r"_scaled_dot_product_\w*attention(_for_cpu)?")


def policy_name(op_name: str) -> str:
    """An operator's name in `train.ac_saved_ops`: its overload packet's name, "sdpa" for attention kernels."""
    return "sdpa" if _SDPA.fullmatch(op_name) else op_name


def listed_policy(saved_ops: list[str]) -> Callable:
    """A fresh policy for one checkpointed call that keeps the outputs `saved_ops` lists (`train.ac_saved_ops`:
    "mm" keeps every matmul of the block, "mul#2" its third multiplication) and recomputes the rest. Calls are
    counted per operator, per call and pass, so the recompute decides alike."""
    every = {name for name in saved_ops if "#" not in name}
    calls = {(name, int(k)) for name, k in (entry.split("#") for entry in saved_ops if "#" in entry)}
    counts: dict[bool, dict[str, int]] = {False: defaultdict(int), True: defaultdict(int)}

    def policy(ctx, func, *args, **kwargs):
        name = policy_name(func._overloadpacket.__name__)
        seen = counts[ctx.is_recompute]
        k = seen[name]
        seen[name] += 1
        keep = name in every or (name, k) in calls
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy
