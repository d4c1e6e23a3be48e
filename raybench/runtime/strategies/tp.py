"""Tensor parallelism (DTensor): every rank holds a slice of each attention and MLP projection.

Megatron-style pairing per decoder block: q/k/v and gate/up are split by output features (ColwiseParallel),
o and down by input features (RowwiseParallel), and heads stay whole on a rank (hence tp must divide the
attention and KV heads). Where `TrainSpec.tp_sequence_parallel` holds, the rest of the model follows
torchtitan's layout:
- sequence parallelism: between the projections, the residual stream and the norms are split over the
  sequence; each block all-gathers its norms' outputs before attention and the MLP, and reduce-scatters their
  outputs, where plain TP would all-reduce them (the same bytes), so no rank keeps or normalizes the whole
  sequence;
- the input embedding and the LM head are split over the vocabulary, and the cross-entropy runs on the split
  logits (torch's loss_parallel), never gathering them: at Qwen2.5-72B's 152,064-entry vocabulary the whole
  fp32 logits of 2 x 4096 tokens are 4.6 GiB per rank.
Otherwise (a head tied to the embedding, or Liger's kernels) only the projections are split: the norms run on
the whole sequence and the embedding and head stay whole on every rank.

LoRA adapters are split with their base projection, the way Megatron-style frameworks split them (NeMo's
ParallelLinearAdapter): on a column-parallel base, A whole and B split by output features; on a row-parallel
base, A split by input features and B whole, so that A's partial output, through B, joins the base's partial
output and the sum is reduced in the base's one all-reduce (or reduce-scatter under sequence parallelism).
PEFT's own tensor-parallel LoRA needs transformers' `from_pretrained(tp_plan=...)` loading (raybench builds on
the meta device and parallelizes with torch's styles) and reduces a row-parallel adapter in a collective of its
own; `LoraColwiseParallel` and `LoraRowwiseParallel` are torch's two styles taught the PEFT layer. Dropout on
the adapter's input draws the same mask on every rank of a TP group (every rank seeds alike, warm_up), as the
unsplit model draws one mask for the replicated activations.

All ranks of a TP group must see the same batch: the worker feeds data by data-parallel rank
(`strategies.data_parallel_rank`). Here the TP group is the whole world.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from raybench.runtime.model import decoder_blocks
from raybench.runtime.strategies import RankContext, Trainable, already_materialized, autocast_for, torch_trainable
from raybench.spec.sweep_spec import TrainSpec

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
SEQUENCE = Shard(1)  # (batch, sequence, hidden)


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: its base projection in `base_layer`, its adapters in `lora_A`/`lora_B` (by name)."""
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "base_layer")


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a PEFT LoRA layer: the base weight (and bias) and each B split by output features, each A
    whole. The input arrives replicated; B's input gradient is partial per rank and joins the base's in the one
    all-reduce of the input's gradient that ColwiseParallel already makes."""

    def _partition_lora_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "base_layer" or name.startswith("lora_B."):
            self._partition_linear_fn(name, module, device_mesh)
        elif name.startswith("lora_A."):
            _replicate(module, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_lora_layer(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_lora_fn,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a PEFT LoRA layer: the base weight and each A split by input features, each B whole. The
    base's output and B's (of A's partial output) are both partial sums, so PEFT's `base + B(A(x)) * scale` stays
    one partial sum, reduced once by RowwiseParallel's output redistribution."""

    def _partition_lora_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "base_layer" or name.startswith("lora_A."):
            self._partition_linear_fn(name, module, device_mesh)
        elif name.startswith("lora_B."):
            _replicate(module, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_lora_layer(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel sets for a Linear
        return distribute_module(
            module, device_mesh, self._partition_lora_fn,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _replicate(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Every parameter of `module` as a replicated DTensor (one computation's operands must all be DTensors)."""
    for name, param in module.named_parameters(recurse=False):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]),
                                                     requires_grad=param.requires_grad))


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    """The parallelize plan of one decoder block, by full module name inside it.

    Found by leaf name rather than fixed paths so the plan also reaches into checkpoint wrappers. A projection
    with LoRA adapters is the PEFT layer of that name (its nn.Linear is its `base_layer`): the LoRA styles split
    it whole.
    """
    plan = {}
    for name, _ in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            plan[name] = LoraColwiseParallel()
        elif leaf in ROWWISE:
            plan[name] = LoraRowwiseParallel(output_layouts=SEQUENCE, use_local_output=False) \
                if sequence_parallel else LoraRowwiseParallel()
        elif sequence_parallel and leaf in NORMS:
            plan[name] = SequenceParallel()
        elif sequence_parallel and leaf == "self_attn":  # one all-gather of the norm's output for q, k and v
            plan[name] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQUENCE},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})
        elif sequence_parallel and leaf == "mlp":
            plan[name] = PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),))
    if not any(isinstance(style, (ColwiseParallel, RowwiseParallel)) for style in plan.values()):
        raise ValueError(f"no {'/'.join(COLWISE + ROWWISE)} projections in {type(block).__name__}: "
                         "tensor parallelism supports Llama/Qwen2-style blocks")
    return plan


def outer_plan(model: nn.Module) -> dict:
    """The parallelize plan around the blocks under sequence parallelism: the embedding split by rows over the
    vocabulary (each rank looks up the ids in its rows; the ranks' outputs are summed and split over the
    sequence), the final norm on each rank's part of the sequence, and the head split by output features over
    the vocabulary, its logits left split (a DTensor) for the loss under loss_parallel."""
    names = {id(module): name for name, module in model.named_modules()}
    return {
        names[id(model.get_input_embeddings())]: RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQUENCE,
                                                                 use_local_output=False),
        names[id(model.get_decoder().norm)]: SequenceParallel(),
        names[id(model.get_output_embeddings())]: ColwiseParallel(input_layouts=SEQUENCE, output_layouts=Shard(-1),
                                                                  use_local_output=False),
    }


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, train: TrainSpec) -> Callable[[], ContextManager]:
    """Split the model over tp_mesh in place: every block's projections, and the rest as the module docstring
    says where `train.tp_sequence_parallel`; returns what forward and backward must run in (loss_parallel, or
    nothing)."""
    sequence_parallel = train.tp_sequence_parallel(model.config.tie_word_embeddings)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for block in decoder_blocks(model):
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, tp_mesh, outer_plan(model))
    # torch's SequenceParallel gives the norms new Parameters that require grad: a LoRA base's frozen norms would
    # train. Every parameter keeps the flag it had.
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    return loss_parallel if sequence_parallel else contextlib.nullcontext


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm when grads mix plain tensors and DTensors on different meshes.

    torch's clip_grad_norm_ stacks all per-tensor norms, which fails across meshes (TP DTensors next to
    replicated plain tensors; or 2D and dp-only DTensors under TP x FSDP2). Each mesh's group gets its own
    norm (a DTensor norm is reduced over its mesh by full_tensor()), and the groups combine as a root sum of
    squares. Replicated parameters count once, as in a single-device run.

    Like clip_grad_norm_, it never reads the norm on the host, which would sync every step inside the timed
    loop: the coefficient stays a device tensor, clamped to 1, and multiplies every gradient (by 1 when the
    norm is under max_norm). As there, a non-finite norm is not skipped (GradScaler skips that step anyway).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    total = torch.linalg.vector_norm(torch.stack(norms))  # root sum of squares of the groups' norms
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups.values():
        torch._foreach_mul_(group, coef)  # a 0-dim tensor: DTensor treats it as replicated
    return total


def setup(model: nn.Module, train: TrainSpec, ctx: RankContext, materialize=already_materialized) -> Trainable:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("tp",))
    loss_context = parallelize(model, mesh, train)
    materialize(False)
    # Every rank computes the same replicated parameters' gradients (TP all-reduces activations, not grads),
    # so there is nothing to skip between micro-batches.
    return torch_trainable(model, train, ctx, no_grad_sync=torch.enable_grad,
                           autocast=autocast_for(train, ctx.device), clip_grad_norm=clip_grad_norm,
                           loss_context=loss_context)
