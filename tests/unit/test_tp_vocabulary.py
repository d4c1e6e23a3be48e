"""Tensor parallelism in torchtitan's layout: sequence parallelism between the blocks' projections, and the input
embedding and LM head split over the vocabulary (the loss runs on the split logits under loss_parallel), except
where the two share one weight or Liger needs whole tensors. The numbers are checked end to end by
tests/integration/test_strategies.py (TP against one rank, TP x FSDP2 against DDP); here, on a fake 2-rank
group (the tiny preset's 2 KV heads allow tp 2), which parameters are split and where the sequence is."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from raybench.rehearse.fake_world import init_fake_world
from raybench.runtime.build import build_meta
from raybench.runtime.strategies import tp
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import ModelSpec, TrainSpec


@pytest.fixture
def mesh():
    init_fake_world(0, 2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def parallelized(mesh, tied: bool = False, **train):
    shape = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    model, _, _ = build_meta(ModelSpec(preset="tiny"), seed=0, shape=shape)
    context = tp.parallelize(model, mesh, TrainSpec(strategy="tp", tp_size=2, **train))
    return model, context


def test_embedding_and_head_are_split_over_the_vocabulary_and_the_residual_stream_over_the_sequence(mesh):
    model, context = parallelized(mesh)
    for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        assert weight.to_local().shape[0] == PRESETS["tiny"].vocab_size // 2
    assert context is loss_parallel
    block = model.model.layers[0]
    assert block.input_layernorm._forward_pre_hooks  # what the other layout's norms lack (below)
    seen = {}

    def record(name, value) -> None:  # a forward hook that returns nothing leaves the output as it is
        seen[name] = value

    block.input_layernorm.register_forward_hook(lambda m, args, out: record("norm", out))
    block.self_attn.q_proj.register_forward_hook(lambda m, args, out: record("q_input", args[0]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        ids = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 64))
        with context():
            model(input_ids=ids, labels=ids, use_cache=False)
    # The norm runs on half of the sequence; attention's projections see all of it, gathered once.
    assert isinstance(seen["norm"], DTensor) and seen["norm"].placements == (Shard(1),)
    assert seen["norm"].to_local().shape[1] == 32
    assert seen["q_input"].placements == (Replicate(),) and seen["q_input"].to_local().shape[1] == 64


@pytest.mark.parametrize("case", [{"tied": True}, {"liger": True}])
def test_a_tied_head_or_liger_splits_the_projections_only(mesh, case):
    model, context = parallelized(mesh, **case)
    assert not isinstance(model.get_input_embeddings().weight, DTensor)
    assert not isinstance(model.get_output_embeddings().weight, DTensor)
    assert context is contextlib.nullcontext
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)  # the blocks are split either way
    assert not model.model.layers[0].input_layernorm._forward_pre_hooks  # the norms see the whole sequence
