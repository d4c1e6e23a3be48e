"""Run under torchrun by test_tp_lora.py: LoRA under tensor parallelism computes what the unsplit model computes.

Every rank builds the tiny preset with LoRA adapters twice from the same seed: once whole (the reference, as one
DDP rank holds it) and once split by the trial's strategy (tp over all ranks, or tp_fsdp2 with TP groups of 2).
Both take one forward and backward on the same batch (every rank the same batch, so a data-parallel average is
that batch's gradient); rank 0 compares the loss and every adapter's gathered gradient, and the base stays
frozen. argv: strategy, then cases as targets:ac_ratio:compile[:dropout] (e.g. all_linear:1/2:0). Exits non-zero
naming each difference.

With dropout the masks of a row-parallel adapter's split input cannot be the unsplit model's on CPU (DTensor's
random ops follow the global tensor only on CUDA), so a dropout case checks what keeps training consistent
instead: every rank of the TP group draws the same mask for a column-parallel adapter's input, which every rank
holds whole (different masks would give the replicated A a gradient no single model has); and the split step
equals the split step on PEFT's own path from the same RNG state, where each adapter keeps its mask, so backward
(which draws raybench's masks again, techniques/lora.py) used forward's masks.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from raybench.runtime import strategies
from raybench.runtime.build import TECHNIQUES, build_meta, fill, prepare_model
from raybench.runtime.strategies import RankContext
from raybench.runtime.strategies.tp import COLWISE
from raybench.runtime.techniques import lora as lora_technique
from raybench.runtime.techniques.lora import DroppedInputLinear
from raybench.spec.sweep_spec import LoraSpec, ModelSpec, TrainSpec

CPU = torch.device("cpu")
SEED = 7
# Same math in another order: fp32 sums of a few hundred terms differ by a few ulps of their largest term.
RTOL, ATOL = 1e-4, 1e-6
# Wrapper path components (checkpointing, compile, FSDP) that differ between the two builds' parameter names.
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class PeftStoredDropout:
    """The LoRA technique on PEFT's own path (each adapter keeps its dropped input and mask), the reference for
    the recomputed dropout: fp32 cases only (no base cast)."""

    wanted = staticmethod(lora_technique.wanted)
    apply = staticmethod(lora_technique.peft_lora)


def forward_backward(train: TrainSpec, world: int, before_forward=lambda model: None,
                     techniques: tuple = TECHNIQUES) -> tuple:
    """(loss, whole adapter gradients by name, names of trainable base parameters) of one step."""
    model, source, info = build_meta(ModelSpec(preset="tiny"), seed=SEED)
    model = prepare_model(model, train, techniques)
    if world == 1:
        fill(model, CPU, source, info, whole=True)
        trainable = strategies.Trainable(model, None, None, None, None, None)
    else:
        ctx = RankContext(dist.get_rank(), world, 0, CPU)
        trainable = strategies.setup(train.strategy, model, train, ctx, lambda whole: fill(model, CPU, source, info,
                                                                                             whole))
    nonzero_b(trainable.model)
    before_forward(trainable.model)
    ids = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(SEED))
    with trainable.loss_context():
        loss = trainable.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    grads, frozen_with_grad = {}, []
    for name, param in trainable.model.named_parameters():
        for part in WRAPPERS:
            name = name.replace(part, "")
        if not param.requires_grad:
            continue
        if ".lora_" not in name:
            frozen_with_grad.append(name)
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return float(loss.detach()), grads, frozen_with_grad


@torch.no_grad()
def nonzero_b(model: torch.nn.Module) -> None:
    """Give every B the same random values in both builds: PEFT starts B at zero, where A's gradient is zero too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        if ".lora_B." in name:
            for part in WRAPPERS:
                name = name.replace(part, "")
            seed = sum(name.encode())
            whole = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.1
            param.copy_(distribute_tensor(whole, param.device_mesh, param.placements)
                        if isinstance(param, DTensor) else whole)


def replicated_masks_differ(train: TrainSpec) -> list[str]:
    """Adapters of column-parallel projections (whose input every rank of the TP group holds whole) whose dropped
    input differs between the ranks of the (whole-world) TP group: seen through A's output, as dropout runs inside
    A (techniques/lora.py's DroppedInputLinear), A is replicated and its input is the same on every rank."""
    from torch.distributed.tensor import DTensor

    outputs = {}

    def keep(name):
        return lambda module, args, out: outputs.__setitem__(name, out.to_local() if isinstance(out, DTensor) else out)

    def hooked(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if isinstance(module, DroppedInputLinear) and name.split(".")[-3] in COLWISE:
                module.register_forward_hook(keep(name))

    torch.manual_seed(SEED)  # every rank alike, as the worker seeds them (warm_up)
    forward_backward(train, dist.get_world_size(), before_forward=hooked)
    differ = []
    for name, out in sorted(outputs.items()):
        gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, out.detach().contiguous())
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            differ.append(name)
    return differ if outputs else ["no dropout ran"]


def compare(strategy: str, case: str) -> list[str]:
    targets, ac_ratio, compiled, *dropout = case.split(":")
    world = dist.get_world_size()
    tp_size = world if strategy == "tp" else 2
    lora = LoraSpec(targets=targets, rank=4, dropout=float(dropout[0]) if dropout else 0.0)
    train = TrainSpec(strategy=strategy, tp_size=tp_size, finetune="lora", lora=lora, ac_ratio=ac_ratio,
                      compile=compiled == "1", precision="fp32")
    if lora.dropout:
        problems = [f"{case}: the ranks' dropout masks of {name} differ" for name in replicated_masks_differ(train)]
        # Backward draws forward's masks again (DTensor's random ops under the checkpoint's restored RNG state):
        # the same step as PEFT's stored masks, from the same RNG state.
        torch.manual_seed(SEED)
        loss, grads, _ = forward_backward(train, world)
        torch.manual_seed(SEED)
        peft_loss, peft_grads, _ = forward_backward(train, world, techniques=tuple(
            PeftStoredDropout if t is lora_technique else t for t in TECHNIQUES))
        return problems + differences(f"{case} against PEFT's stored dropout", loss, grads, peft_loss, peft_grads)
    whole = train.model_copy(update={"strategy": "ddp", "tp_size": 1})
    ref_loss, ref_grads, _ = forward_backward(whole, 1)
    loss, grads, trainable_base = forward_backward(train, world)
    problems = [f"{case}: base parameter {name} is trainable" for name in trainable_base]
    return problems + differences(f"{case} against the unsplit model", loss, grads, ref_loss, ref_grads)


def differences(what: str, loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> list[str]:
    """How one step's loss and adapter gradients differ from the reference's, beyond fp32 rounding."""
    problems = []
    if abs(loss - ref_loss) > RTOL * abs(ref_loss):
        problems.append(f"{what}: loss {loss} != {ref_loss}")
    if grads.keys() != ref_grads.keys():
        problems.append(f"{what}: adapters {sorted(grads.keys() ^ ref_grads.keys())} on one side only")
    for name in grads.keys() & ref_grads.keys():
        if not torch.allclose(grads[name], ref_grads[name], rtol=RTOL, atol=ATOL):
            diff = (grads[name] - ref_grads[name]).abs().max().item()
            problems.append(f"{what}: gradient of {name} differs by {diff:.3g}")
    if not any(g.abs().sum() > 0 for name, g in ref_grads.items() if ".lora_A." in name):
        problems.append(f"{what}: every A gradient is zero: B must be nonzero for the comparison to mean anything")
    return problems


def main(strategy: str, cases: list[str]) -> int:
    dist.init_process_group("gloo")
    problems = [p for case in cases for p in compare(strategy, case)]
    if dist.get_rank() == 0:
        print("\n".join(problems) or f"{strategy}: {len(cases)} cases equal to the unsplit model")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
