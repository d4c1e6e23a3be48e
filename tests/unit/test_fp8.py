"""train.fp8: which linears torchao's float8 training takes (runtime/techniques/fp8.py), and that a step through them
runs, checked on CPU with torchao's emulation (the casts, scales and FP8 rounding in plain matmuls). The GPU run is
tests/gpu/test_gpu_techniques.py::test_fp8_trains; the refusals are in test_strategy_rules.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from raybench.runtime.techniques import fp8, lora
from raybench.spec.sweep_spec import TrainSpec

pytest.importorskip("torchao")


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


BLOCK_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_full_fine_tune_converts_every_block_linear_and_not_the_head():
    model = fp8.convert(tiny_model(), TrainSpec(fp8="tensorwise"), emulate=True)
    names = fp8.converted(model)
    assert {name.rsplit(".", 1)[1] for name in names} == BLOCK_LINEARS
    assert len(names) == 2 * len(BLOCK_LINEARS) and not any("lm_head" in name for name in names)


def test_lora_converts_the_frozen_base_linears_only():
    train = TrainSpec(fp8="rowwise", finetune="lora", lora={"targets": "attention_mlp", "rank": 8})
    model = fp8.convert(lora.apply(tiny_model(), train), train, emulate=True)
    names = fp8.converted(model)
    assert names and all(name.endswith(".base_layer") for name in names)
    assert {name.split(".")[-2] for name in names} == BLOCK_LINEARS


def test_a_linear_whose_dimensions_miss_the_fp8_tile_stays_as_it_is():
    layer = torch.nn.Linear(64, 40)  # 40 is not a multiple of 16
    assert not fp8.eligible(layer, "model.layers.0.mlp.up_proj", lora=False)
    assert fp8.eligible(torch.nn.Linear(64, 48), "model.layers.0.mlp.up_proj", lora=False)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_step_through_emulated_fp8_linears_trains_like_bf16(recipe):
    """Forward and backward through the FP8 linears give a finite loss and a gradient to every weight. e4m3's 3
    mantissa bits round each cast element by at most 2^-4 of its scale, so on this model at initialization (its
    logits near 0, the loss near ln(vocab)) the loss moves by a small fraction: held within 1% of bf16's."""
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = tiny_model().to(torch.bfloat16)
    converted = fp8.convert(copy.deepcopy(reference), TrainSpec(fp8=recipe), emulate=True)
    losses = []
    for model in (reference, converted):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[1] == pytest.approx(losses[0], rel=0.01)
    for name in fp8.converted(converted):
        grad = converted.get_submodule(name).weight.grad
        assert grad is not None and torch.isfinite(grad.float()).all() and grad.abs().sum() > 0, name


def test_lora_adapters_train_over_an_fp8_base():
    """The frozen base runs in FP8 and gets no gradient; the adapters beside it do."""
    train = TrainSpec(fp8="tensorwise", finetune="lora", lora={"targets": "attention_mlp", "rank": 8})
    model = fp8.convert(lora.apply(tiny_model(), train), train, emulate=True)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    adapters = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert adapters and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
    assert all(model.get_submodule(name).weight.grad is None for name in fp8.converted(model))


def test_the_row_names_the_fp8_matmuls_and_their_share_of_the_model_flops():
    """fp8.columns: the converted linears by kind, and their matmuls' share of spec.metrics' FLOPs per token,
    counted here from the model's own block linears (6 FLOPs a weight a token trained, 4 for a frozen base)."""
    from raybench.spec import metrics

    model = tiny_model()
    config = model.config
    block_weights = sum(m.weight.numel() for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and ".layers." in name)
    params = sum(p.numel() for p in model.parameters())
    matmul = metrics.matmul_params(params, config.vocab_size, config.hidden_size, False)
    for finetune, per_weight in (("full", 6), ("lora", 4)):
        train = TrainSpec(fp8="tensorwise", finetune=finetune, lora={"targets": "attention_mlp", "rank": 8})
        built = fp8.convert(lora.apply(copy.deepcopy(model), train) if finetune == "lora" else copy.deepcopy(model),
                            train, emulate=True)
        flops = metrics.flops_per_token(matmul, params, finetune == "full", config.num_hidden_layers, 32,
                                        config.hidden_size)
        row = fp8.columns(fp8.converted(built), finetune == "full", flops)
        suffix = ".base_layer" if finetune == "lora" else ""
        assert json.loads(row["fp8_linear_kinds_json"]) == sorted(
            f"{'self_attn' if kind.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{kind}{suffix}"
            for kind in BLOCK_LINEARS)
        assert row["fp8_linears"] == 2 * len(BLOCK_LINEARS)
        assert row["fp8_flops_frac"] == pytest.approx(per_weight * block_weights / flops, rel=1e-12)
