"""LoRA dropout recomputed in backward (techniques/lora.py's DroppedInputLinear) against PEFT's own path.

One process, the tiny preset with LoRA on every linear: from the same seed the recomputed path draws PEFT's
masks in forward and the same masks again in backward, so its losses and adapter gradients are PEFT's to fp32
rounding, at dropout 0 and above; the masks keep PEFT's distribution (binomial keep fraction, scale 1/(1-p),
independent per module); PEFT's files on disk are unchanged; and the rehearsal traces the path, where dropout costs
no activation memory."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from raybench.runtime.build import build_meta, fill
from raybench.runtime.techniques import lora
from raybench.spec.sweep_spec import LoraSpec, ModelSpec, TrainSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rehearse_cases import fake_trace, tiny_trial  # noqa: E402

CPU = torch.device("cpu")
SEED = 3


def tiny_lora(dropout: float, recomputed: bool, precision: str = "fp32") -> nn.Module:
    """The tiny preset with LoRA r4 on every linear, values from SEED, every B nonzero (PEFT starts B at zero,
    where A's gradient is zero too); on the recomputed path (lora.apply) or PEFT's own (lora.peft_lora)."""
    train = TrainSpec(finetune="lora", precision=precision,
                      lora=LoraSpec(rank=4, targets="all_linear", dropout=dropout))
    model, source, info = build_meta(ModelSpec(preset="tiny"), seed=SEED)
    if recomputed:
        model = lora.apply(model, train)
    else:
        model = lora.peft_lora(model, train)
        lora.store_frozen_in(model, lora.DTYPES[train.lora_base_dtype])  # as lora.apply stores the base
    fill(model, CPU, source, info, whole=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(sum(name.encode()))))
    return model


def step(model: nn.Module, autocast: bool = False) -> tuple[torch.Tensor, dict]:
    """One forward and backward from the same RNG state: the loss and every adapter's gradient by name."""
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(SEED))
    torch.manual_seed(SEED)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_step(recomputed: nn.Module, peft: nn.Module, autocast: bool = False) -> None:
    loss, grads = step(recomputed, autocast)
    ref_loss, ref_grads = step(peft, autocast)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * 7 * 2  # 4 blocks x 7 projections x (A, B)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m: f"{name}: {m}")


def test_dropout_zero_gives_peft_losses_and_gradients():
    """The recomputed path at p = 0 (its cast and A's matmul inside the checkpoint) against PEFT at dropout 0."""
    recomputed = tiny_lora(0.1, recomputed=True)
    for module in recomputed.modules():
        if isinstance(module, lora.DroppedInputLinear):
            module.p = 0.0
    assert_same_step(recomputed, tiny_lora(0.0, recomputed=False))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dropout_draws_pefts_masks_and_backward_draws_them_again(precision):
    """From the same RNG state, forward draws PEFT's masks (same loss); A's gradient (taken from the dropped
    input) and every other gradient equal PEFT's, which used its stored masks, only if backward drew the same
    masks again. bf16: the fp32 adapters under autocast (ddp's, tp's), PEFT's cast now inside the checkpoint."""
    recomputed = tiny_lora(0.1, recomputed=True, precision=precision)
    assert sum(isinstance(m, lora.DroppedInputLinear) for m in recomputed.modules()) == 4 * 7
    assert_same_step(recomputed, tiny_lora(0.1, recomputed=False, precision=precision), autocast=precision == "bf16")


def test_masks_keep_pefts_distribution_independent_per_module():
    """Three adapters reading the same input, as q, k and v do. Each A is one row of ones, so x's gradient is
    backward's mask scaled (ones / (1 - p) where kept, else 0) and A's output is forward's, summed per row.
    Bounds: 5 standard deviations of the binomial counts (a chance failure ~6e-7 per bound)."""
    p, tokens, width = 0.1, 2048, 128
    torch.manual_seed(SEED)
    x = torch.ones(tokens, width)
    masks = []
    for _ in ("q", "k", "v"):
        linear = nn.Linear(width, 1, bias=False)
        nn.init.ones_(linear.weight)
        module = lora.DroppedInputLinear(linear, p)
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.sum().backward()
        kept = leaf.grad != 0
        torch.testing.assert_close(leaf.grad[kept], torch.full_like(leaf.grad[kept], 1 / (1 - p)))
        torch.testing.assert_close(out[:, 0], leaf.grad.sum(-1))  # forward's mask is backward's
        masks.append(kept)
    n = tokens * width

    def within_binomial(count: int, prob: float) -> bool:
        return abs(count - n * prob) <= 5 * math.sqrt(n * prob * (1 - prob))

    for mask in masks:
        assert within_binomial(int(mask.sum()), 1 - p)
    for a, b in ((0, 1), (0, 2), (1, 2)):  # independent: both kept as often as (1 - p)^2 says
        assert within_binomial(int((masks[a] & masks[b]).sum()), (1 - p) ** 2)


def test_pefts_files_on_disk_are_unchanged(tmp_path):
    """save_pretrained of the recomputed path writes PEFT's keys and config (dropout kept), and
    PeftModel.from_pretrained loads it onto a plain base as PEFT's own adapters, every value equal."""
    import peft
    from safetensors.torch import load_file

    recomputed = tiny_lora(0.1, recomputed=True)
    recomputed.save_pretrained(tmp_path)
    peft_dir = tmp_path / "peft"
    tiny_lora(0.1, recomputed=False).save_pretrained(peft_dir)
    saved, peft_saved = load_file(tmp_path / "adapter_model.safetensors"), load_file(
        peft_dir / "adapter_model.safetensors")
    assert saved.keys() == peft_saved.keys()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_dropout"] == 0.1

    base, source, info = build_meta(ModelSpec(preset="tiny"), seed=SEED)
    fill(base, CPU, source, info, whole=True)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    assert not any(isinstance(m, lora.DroppedInputLinear) for m in loaded.modules())  # PEFT's own layers
    ours = dict(recomputed.named_parameters())
    for name, param in loaded.named_parameters():
        if ".lora_" in name:
            assert torch.equal(param, ours[name]), name


# tp with -m slow: its recomputation is checked against PEFT's step in tests/integration/test_tp_lora.py.
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp", pytest.param("tp", marks=pytest.mark.slow)])
def test_rehearsed_dropout_costs_no_activation_memory(strategy):
    """The rehearsal traces the recomputed path: dropout 0.1 keeps at most 5% more activations than dropout 0
    (PEFT's own path kept 43% more under fsdp2 at this shape). Under ddp's and tp's autocast it keeps less:
    PEFT's cast of each adapter's input to fp32 is recomputed too."""
    extra = {"tp_size": 2} if strategy == "tp" else {}

    def activations(dropout: float) -> float:
        trial = tiny_trial(2, strategy=strategy, finetune="lora", seq_len=256,
                           lora={"targets": "all_linear", "dropout": dropout}, **extra)
        return fake_trace(trial).memory_gib["activations"]

    assert activations(0.1) <= 1.05 * activations(0.0)



def test_inductors_partitioner_takes_the_recomputed_dropout():
    """The rehearsal's compiled-block accounting (compiled.py) runs inductor's partitioner, whose joint-graph
    passes need the graph's fake mode set, as inductor's own compile sets it, once random ops (dropout) appear."""
    from raybench.rehearse import compiled

    module = lora.DroppedInputLinear(nn.Linear(16, 4, bias=False), 0.1)
    x = torch.randn(8, 16, requires_grad=True)
    compiled._partitioned_like_inductor(module)(x).sum().backward()
    assert x.grad.shape == x.shape and module.weight.grad.shape == module.weight.shape
