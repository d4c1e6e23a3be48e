"""How tensor parallelism splits LoRA adapters, on a fake 2-rank group (no values): with each projection, as
Megatron-style frameworks do, the frozen base staying frozen, and the estimate counting what a rank holds. That
the split computes the unsplit model's loss and gradients: tests/integration/test_tp_lora.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from raybench.planning.estimate import tp_local_adapters
from raybench.rehearse.fake_world import init_fake_world
from raybench.runtime.build import build_meta, prepare_model
from raybench.runtime.strategies import tp
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import LoraSpec, ModelSpec, TrainSpec


@pytest.fixture
def mesh():
    init_fake_world(0, 2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def split_lora_model(mesh, targets: str):
    train = TrainSpec(strategy="tp", tp_size=2, finetune="lora", lora=LoraSpec(targets=targets))
    model, _, _ = build_meta(ModelSpec(preset="tiny"), seed=0)
    model = prepare_model(model, train)
    tp.parallelize(model, mesh, train)
    return model, train


def placement(param) -> object:
    return param.placements[0] if isinstance(param, DTensor) else None


def test_adapters_split_with_their_projection(mesh):
    model, _ = split_lora_model(mesh, "all_linear")
    block = model.base_model.model.model.layers[0]
    for layer in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.mlp.gate_proj,
                  block.mlp.up_proj):  # column-parallel: B by output features, A whole
        assert placement(layer.base_layer.weight) == Shard(0)
        assert placement(layer.lora_A["default"].weight) == Replicate()
        assert placement(layer.lora_B["default"].weight) == Shard(0)
    for layer in (block.self_attn.o_proj, block.mlp.down_proj):  # row-parallel: A by input features, B whole
        assert placement(layer.base_layer.weight) == Shard(1)
        assert placement(layer.lora_A["default"].weight) == Shard(1)
        assert placement(layer.lora_B["default"].weight) == Replicate()


@pytest.mark.parametrize("targets", ["attention", "attention_mlp", "all_linear"])
def test_only_adapters_train_and_the_estimate_counts_what_a_rank_holds(mesh, targets):
    model, train = split_lora_model(mesh, targets)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)  # the norms too stay frozen
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainable.values())
    assert local == tp_local_adapters(PRESETS["tiny"], train)
    whole = sum(p.numel() for p in trainable.values())
    assert whole == tp_local_adapters(PRESETS["tiny"], train.model_copy(update={"tp_size": 1})) > local
