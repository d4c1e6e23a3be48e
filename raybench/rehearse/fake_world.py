"""The fake world a rehearsal runs in: fake tensors, torch's fake process group (every collective returns at
once), and what the trace needs from it: which ops are collectives and how many bytes each moves, DDP's bucket
all-reduce on the fake group, DTensor's global-shape propagation marked so the trackers can skip it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Inputs built outside the mode (host scalars, the model's own small factory tensors) join the trace.
    return FakeTensorMode(allow_non_fake_inputs=True)


def init_fake_world(rank: int, world_size: int) -> None:
    """A process group of world_size ranks in which this process plays `rank`; collectives do nothing."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class Propagation:
    """DTensor's sharding propagator enters this around its global-shape fake run (`_fake_mode_lock`)."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


@contextlib.contextmanager
def marking_propagation(propagation: Propagation) -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = propagation
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = saved


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """transformers reads the position ids' values to tell packed rows (several sequences, a block-causal mask)
    from one sequence per row (no mask: SDPA's is_causal kernels). Fake tensors have no values, so it would
    assume packing and build a mask; the traced batches hold one sequence per row, as the worker's do (they
    pass no position ids), so say so."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


def fake_allreduce_hook(_state, bucket):  # no return annotation: DDP checks it as an object, not a string
    """DDP's bucket all-reduce on the fake group. DDP's built-in hook hands back the value of the collective's
    future, which the fake group leaves empty; this one runs the all-reduce and hands back the bucket itself.

    It does not divide by the world size as the built-in path does: there the reducer scales each gradient
    while copying it into its bucket, one pass the trace already counts as the copy. And it must not write
    into the bucket: the reducer allocated it outside the fake mode, as real host memory never touched."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def collective_ops() -> tuple[set, set]:
    """(every collective op, the c10d ones that FSDP2 and DDP issue beside compute)."""
    from torch.distributed._tools.fake_collectives import collective_ops, sync_ops

    c10d = torch.ops.c10d
    overlapped = {c10d._allgather_base_.default, c10d._reduce_scatter_base_.default, c10d.allreduce_.default,
                  c10d.allgather_into_tensor_coalesced_.default, c10d.reduce_scatter_tensor_coalesced_.default}
    return (collective_ops | overlapped) - sync_ops, overlapped


def comm_bytes(func, out, args, kwargs) -> int:
    from torch.distributed._tools.fake_collectives import CollectiveOp

    try:
        return int(CollectiveOp.get_comm_tensor_size(func, out, args, kwargs))
    except (NotImplementedError, IndexError, AttributeError, TypeError):
        # torch's table has no entry for this collective's argument layout: count its tensor arguments.
        return sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
