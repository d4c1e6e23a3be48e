"""train.master_weights none (pure bf16): the second option through the seam (spec/options.py): its plan rules, its
technique (every weight kept in bf16 from the meta build on), the estimate's bytes (weights, gradients and optimizer
state in bf16) and the rehearsal, which traces it as the worker runs it. A real 2-rank run of both settings is in
docs/results/master-weights-2026-12-07.md."""

from __future__ import annotations

import pytest
import torch

from raybench.planning import estimate
from raybench.planning.plan import plan
from raybench.rehearse import rehearsal
from raybench.runtime.build import build_meta, prepare_model
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import ModelSpec, TrainSpec
from tests.rehearse_cases import tiny_trial


@pytest.mark.parametrize("train, words", [
    ({"precision": "fp32"}, "set train.precision: bf16"),
    ({"precision": "bf16", "finetune": "lora"}, "its dtype is train.lora.base_dtype"),
    ({"precision": "bf16", "strategy": "deepspeed", "zero_stage": 2}, "keeps an fp32 master copy itself"),
])
def test_the_plan_refuses_bf16_weights_where_they_cannot_run(train, words):
    spec = parse_sweep({"name": "s", "model": {"preset": "tiny"}, "train": {"master_weights": "none", **train},
                        "resources": {"workers": 2}})
    with pytest.raises(ConfigError) as err:
        plan(spec)
    assert "train.master_weights" in str(err.value) and words in str(err.value)


def test_the_default_keeps_the_ids_and_none_is_another_trial():
    spec = {"name": "s", "model": {"preset": "tiny"}, "train": {"precision": "bf16"}}
    default, fp32, none = (plan(parse_sweep({**spec, "train": {**spec["train"], **extra}}))[0]
                           for extra in ({}, {"master_weights": "fp32"}, {"master_weights": "none"}))
    assert default.trial_id == fp32.trial_id != none.trial_id


def test_every_weight_is_kept_in_bf16_from_the_meta_build_buffers_not():
    train = TrainSpec(precision="bf16", master_weights="none")
    model, _, _ = build_meta(ModelSpec(preset="tiny"), seed=0)
    model = prepare_model(model, train)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}  # rotary frequencies


def test_the_estimate_keeps_weights_gradients_and_states_in_bf16():
    shape = PRESETS["llama-3-8b"]

    def est(strategy: str, master: str) -> estimate.Estimate:
        config = parse_sweep({"name": "s", "model": {"preset": "llama-3-8b"}, "train": {
            "strategy": strategy, "precision": "bf16", "master_weights": master, "seq_len": 2048, "loss": "full"},
            "resources": {"workers": 8, "gpus_per_worker": 1}})
        (trial,) = plan(config)
        return estimate.estimate(trial.config, shape, [])

    for strategy in ("fsdp2", "ddp"):
        mixed, pure = est(strategy, "fp32"), est(strategy, "none")
        assert pure.optimizer_gib == pytest.approx(mixed.optimizer_gib / 2)  # two AdamW moments, 2 bytes each
        assert pure.params_gib < mixed.params_gib and pure.grads_gib < mixed.grads_gib
    n = estimate.param_counts(shape, TrainSpec()).total
    ddp = est("ddp", "none")
    assert ddp.params_gib * 2**30 == pytest.approx(2 * n)  # the bf16 weights themselves: no autocast copies
    assert ddp.grads_gib * 2**30 == pytest.approx(2 * 2 * n)  # bf16 gradients and DDP's bucket copy


def test_the_rehearsal_traces_the_bf16_state():
    """The trace builds the model with the worker's techniques: the optimizer's moments take the weights' dtype."""
    mixed, pure = (tiny_trial(2, gpus=1, strategy="fsdp2", master_weights=m) for m in ("fp32", "none"))
    rehearsed = {m: rehearsal.rehearse(t.config, t.shape, "H100 SXM").memory_gib for m, t in (("fp32", mixed),
                                                                                               ("none", pure))}
    # Half, but for AdamW's step counters (an fp32 scalar per weight, whatever its dtype).
    assert rehearsed["none"]["optimizer_state"] == pytest.approx(rehearsed["fp32"]["optimizer_state"] / 2, rel=1e-3)
    assert rehearsed["none"]["parameters"] < rehearsed["fp32"]["parameters"]
