"""Run under torchrun by test_zero3_gathered.py: for each of the ZeRO-3 settings given as a JSON list in argv[1],
a small Llama-shaped model under DeepSpeed ZeRO-3 (`strategies.deepspeed.setup`) takes three training steps; in
each, as backward begins (the logits' gradient made, the head's backward not yet run), it sums the elements of
the parameters DeepSpeed holds gathered. Rank 0 prints one JSON line per settings: those sums by step, and what
`zero3_gathered.gathered_at_backward` predicts for the model and settings. Then, under ZeRO-2 with DeepSpeed's
defaults, the collectives each of two steps calls in order, the optimizer's step among them (one JSON line): where
ZeRO-2 gathers its weights (rehearse/step_time.gathered_after_step)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from raybench.planning import estimate, zero3_gathered
from raybench.runtime.build import build_meta, fill
from raybench.runtime.strategies import RankContext, deepspeed
from raybench.spec.presets import ModelShape
from raybench.spec.sweep_spec import ModelSpec, TrainSpec

CPU = torch.device("cpu")
# 4 blocks (hidden 96, MLP 256) and a 512 x 96 head: the settings the test gives set apart the head, the blocks,
# the live limit and the persistent norms.
SHAPE = ModelShape("llama", hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)


def main(all_settings: list[dict]) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed as ds  # noqa: F401  DeepSpeed picks its accelerator at its first import

    dist.init_process_group("gloo")
    for settings in all_settings:
        gathered_by_step = steps(settings)
        modules = zero3_gathered.forward_modules(SHAPE, estimate.projection_shapes(SHAPE), (), 0, ())
        # DeepSpeed takes every setting given; the count reads those it models (not the prefetch bucket's size).
        modelled = {k: v for k, v in settings.items() if k in zero3_gathered.Zero3Settings.__dataclass_fields__}
        predicted = zero3_gathered.gathered_at_backward(modules, zero3_gathered.Zero3Settings(**modelled))
        if dist.get_rank() == 0:
            print(json.dumps({"settings": settings, "gathered_by_step": gathered_by_step, "predicted": predicted,
                              "model_elements": sum(modules)}), flush=True)
    order = collectives_by_step(2)
    if dist.get_rank() == 0:
        print(json.dumps({"stage": 2, "collectives_by_step": order}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def collectives_by_step(stage: int) -> list[list[str]]:
    """Two ZeRO-`stage` steps with DeepSpeed's defaults: the collectives DeepSpeed's communication backend runs in
    each, in order, with "optimizer" where the wrapped optimizer's step ends."""
    import deepspeed.comm.comm as ds_comm

    trainable = setup(stage, {})
    calls: list[str] = []
    backend = ds_comm.cdb
    names = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce", "reduce", "broadcast")
    originals = {name: getattr(backend, name) for name in names}

    def recorded(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(backend, name, recorded(name))
    trainable.model.optimizer.optimizer.register_step_post_hook(lambda *args: calls.append("optimizer"))
    by_step = []
    try:
        for _ in range(2):
            calls.clear()
            train_step(trainable)
            by_step.append(list(calls))
    finally:
        for name, original in originals.items():
            setattr(backend, name, original)
    return by_step


def setup(stage: int, settings: dict):
    """The small model under DeepSpeed ZeRO-`stage` through raybench's strategy, with `settings` (stage3_...)."""
    torch.manual_seed(0)
    train = TrainSpec(strategy="deepspeed", zero_stage=stage, precision="fp32", seq_len=16, micro_batch=1)
    model, source, info = build_meta(ModelSpec(preset="tiny"), seed=0, shape=SHAPE)
    config = deepspeed.ds_config

    def with_settings(*args):
        built = config(*args)
        built["zero_optimization"].update(settings)
        return built

    deepspeed.ds_config = with_settings
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), 0, CPU)
    try:
        return deepspeed.setup(model, train, ctx, lambda whole: fill(model, CPU, source, info, whole))
    finally:
        deepspeed.ds_config = config


TOKENS = torch.randint(0, SHAPE.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))


def train_step(trainable, on_logits=None) -> None:
    out = trainable.model(input_ids=TOKENS, use_cache=False)
    if on_logits:
        out.logits.register_hook(on_logits)
    loss = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), TOKENS[0, 1:])
    trainable.backward(loss)
    trainable.step()


def steps(settings: dict) -> list[int]:
    """Three steps under `settings`; the parameter elements gathered as each one's backward began."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    trainable = setup(3, {f"stage3_{name}": value for name, value in settings.items()})
    engine = trainable.model
    gathered_by_step = []

    def count_gathered(grad):
        gathered_by_step.append(sum(p.ds_numel for p in engine.module.parameters()
                                    if p.ds_status == ZeroParamStatus.AVAILABLE))
        return grad

    for _ in range(3):  # DeepSpeed prefetches once its first step has recorded the modules' order
        train_step(trainable, count_gathered)
    return gathered_by_step


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
