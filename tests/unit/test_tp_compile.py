"""torch.compile with whole-block checkpointing under tensor parallelism: where the compiled region sits
(`compile.compiled_region`), and the torch failure that decides it, on a fake 2-rank group with AOT autograd's
eager backend (its partitioner is the one inductor uses; no code is generated). Real training through the
arrangement is checked by tests/integration/test_strategies.py (its tp case with compile)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from raybench.rehearse.fake_world import init_fake_world
from raybench.runtime.build import build_meta, build_model
from raybench.runtime.model import decoder_blocks
from raybench.runtime.strategies import tp
from raybench.runtime.techniques import activation_checkpointing, compile
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import ModelSpec, TrainSpec

TRAIN = TrainSpec(strategy="tp", tp_size=2, ac_ratio="1", compile=True)


@pytest.fixture
def mesh():
    init_fake_world(0, 2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def loss_and_grads(mesh, region) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward of the tiny preset, checkpointed whole and tensor-parallel, its blocks compiled
    where `region(block)` says (None: eager); the loss and the local gradients."""
    model, _ = build_model(ModelSpec(preset="tiny"), torch.device("cpu"), seed=0)
    activation_checkpointing.apply(model, TRAIN)
    if region is not None:
        torch.compiler.reset()
        for block in decoder_blocks(model):
            region(block).compile(backend="aot_eager")
    loss_context = tp.parallelize(model, mesh, TRAIN)
    ids = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with loss_context():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
    return value, [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]


def test_torch_still_fails_a_compiled_checkpoint_around_a_tensor_parallel_block(mesh):
    """The failure `compiled_region` works around. When a torch upgrade makes this pass, compile the whole
    checkpointed block again under TP (drop the exception in `compiled_region` and in plan.py)."""
    with pytest.raises(AssertionError, match="tensors_saved_with_vc_check"):
        loss_and_grads(mesh, lambda block: block)


def test_tensor_parallel_blocks_compile_inside_their_checkpoint_and_match_eager(mesh):
    eager_loss, eager_grads = loss_and_grads(mesh, None)
    loss, grads = loss_and_grads(mesh, lambda block: compile.compiled_region(block, TRAIN))
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for grad, eager in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager, rtol=1e-4, atol=1e-6)


def test_other_strategies_and_op_level_blocks_compile_with_their_checkpoint():
    model, _, _ = build_meta(ModelSpec(preset="tiny"), seed=0)
    activation_checkpointing.apply(model, TRAIN)
    block = decoder_blocks(model)[0]
    assert compile.compiled_region(block, TRAIN) is block._checkpoint_wrapped_module
    for train in (TrainSpec(strategy="fsdp2", ac_ratio="1", compile=True),
                  TRAIN.model_copy(update={"ac_mode": "op"})):
        assert compile.compiled_region(block, train) is block


def autograd_cache_lookups(train: TrainSpec) -> int:
    """AOT autograd cache hits and misses of one inductor compile (forward and backward) under the trial's
    scope; 0 when the cache is off."""
    from torch._dynamo.utils import counters

    def lookups() -> int:
        return counters["aot_autograd"]["autograd_cache_hit"] + counters["aot_autograd"]["autograd_cache_miss"]

    torch.compiler.reset()
    before = lookups()
    with compile.trial_scope(train):
        x = torch.randn(8, requires_grad=True)
        torch.compile(lambda t: (t.sin() * 2).sum())(x).backward()
    return lookups() - before


def test_compiled_tensor_parallel_trials_run_without_the_autograd_cache():
    """A warm actor's later compiled TP trials crashed on cached graphs (docs/results/warm-fidelity-2026-11-26.md):
    TP trials compile without AOT autograd's cache, the other trials keep it, and the setting is restored."""
    assert autograd_cache_lookups(TrainSpec(strategy="fsdp2", compile=True)) == 1
    assert autograd_cache_lookups(TRAIN) == 0
    assert autograd_cache_lookups(TrainSpec(strategy="tp_fsdp2", tp_size=2, compile=True)) == 0
    assert torch._functorch.config.enable_autograd_cache
