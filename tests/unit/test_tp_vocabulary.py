"""Tensor parallelism splits the LM head over the vocabulary (the loss then runs on the split logits under
loss_parallel), except where it is the embedding's weight or Liger needs the whole head. The
numbers are checked end to end by tests/integration/test_strategies.py (TP against one rank, TP x FSDP2 against
DDP); here, on a fake 4-rank group, which parameters are split."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from raybench.config import ModelSpec, TrainSpec
from raybench.model import build_meta
from raybench.presets import PRESETS
from raybench.rehearse.trace import init_fake_world
from raybench.strategies import tp


@pytest.fixture
def mesh():
    init_fake_world(0, 4)
    yield init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def parallelized(mesh, tied: bool = False, **train):
    shape = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    model, _, _ = build_meta(ModelSpec(preset="tiny"), seed=0, shape=shape)
    context = tp.parallelize(model, mesh, TrainSpec(strategy="tp", tp_size=4, **train))
    return model, context


def test_the_head_is_split_over_the_vocabulary(mesh):
    model, context = parallelized(mesh)
    head = model.get_output_embeddings().weight
    assert isinstance(head, DTensor) and head.placements == (Shard(0),)
    assert head.to_local().shape[0] == PRESETS["tiny"].vocab_size // 4
    assert context is loss_parallel
    # The embedding stays whole (split, its backward fails under compiled blocks in torch 2.13), norms too.
    assert not isinstance(model.get_input_embeddings().weight, DTensor)
    assert not isinstance(model.model.norm.weight, DTensor)


@pytest.mark.parametrize("case", [{"tied": True}, {"liger": True}])
def test_a_tied_head_or_liger_keeps_them_whole(mesh, case):
    model, context = parallelized(mesh, **case)
    assert not isinstance(model.get_input_embeddings().weight, DTensor)
    assert not isinstance(model.get_output_embeddings().weight, DTensor)
    assert context is contextlib.nullcontext
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)  # the blocks are split either way
