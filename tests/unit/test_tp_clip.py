"""Tensor parallelism's gradient clipping: the global norm across meshes, clipped without a host sync."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from raybench.runtime.strategies.tp import clip_grad_norm


def params_with_grads(*grads: torch.Tensor) -> list[torch.Tensor]:
    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    return params


def global_norm(params: list[torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()


@contextlib.contextmanager
def no_host_reads():
    """Reading a tensor's value on the host (a device sync on GPUs) raises inside this block."""
    def refuse(*args, **kwargs):
        raise AssertionError("clip_grad_norm read a tensor on the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "cpu", "tolist", "__float__", "__bool__"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


def test_clips_to_max_norm_when_larger():
    params = params_with_grads(torch.full((3, 4), 2.0), torch.full((5,), -1.0))
    norm_before = 53 ** 0.5  # sqrt(12 * 4 + 5 * 1)
    with no_host_reads():
        total = clip_grad_norm(params, max_norm=1.0)
    assert total.item() == pytest.approx(norm_before)
    assert global_norm(params) == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(params[0].grad, torch.full((3, 4), 2.0 / norm_before), rtol=1e-5)


def test_leaves_gradients_alone_when_smaller():
    grads = (torch.full((3, 4), 0.1), torch.full((5,), -0.2))
    params = params_with_grads(*grads)
    with no_host_reads():
        total = clip_grad_norm(params, max_norm=1.0)
    assert total.item() == pytest.approx((12 * 0.01 + 5 * 0.04) ** 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_dtensor_and_plain_gradients_share_one_norm(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), one_rank_mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(torch.full((4, 4), 3.0), one_rank_mesh, [Shard(0)])
    (plain,) = params_with_grads(torch.full((4,), 4.0))
    total = clip_grad_norm([sharded, plain], max_norm=2.0)
    assert total.item() == pytest.approx((16 * 9 + 4 * 16) ** 0.5)
    clipped = [sharded.grad.full_tensor(), plain.grad]
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped])).item() == pytest.approx(2.0, rel=1e-5)
