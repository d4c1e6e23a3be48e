"""What torch.compile changes in a compiled trial's decoder blocks, counted by inductor itself on one block: what
its partitioner keeps for backward, and the bytes its generated kernels move."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from raybench.rehearse.fake_world import fake_mode, init_fake_world
from raybench.rehearse.roofline import Roofline, fusable
from raybench.rehearse.traced_model import liger_rope, unwrapped_model
from raybench.runtime import strategies
from raybench.runtime.model import decoder_blocks
from raybench.runtime.strategies import tp
from raybench.runtime.techniques import activation_checkpointing
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import TrainSpec, TrialConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a tensor holds on this rank: a DTensor's shard (its own storage is the global shape's), else itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> dict[int, int]:
    """The allocations a tensor holds on this rank, key -> bytes: a DTensor's shard, a tensor subclass's inner
    tensors (torchao's FP8 weight wraps its bf16 one: a compiled graph saves the inner tensor itself), views
    their base's storage (one key per allocation)."""
    return {st._cdata: st.nbytes() for st in get_untyped_storages(_local(t))}


@dataclass
class _Block:
    """One decoder block of a trial's model as its strategy runs it, and the inputs the model passes it."""

    module: nn.Module
    hidden: torch.Tensor
    kwargs: dict
    autocast: Callable[[], ContextManager]

    def forward(self, run: Callable):
        """`run` (the block itself, or a wrapped or compiled block) on the inputs, under the strategy's autocast."""
        with self.autocast():
            return run(self.hidden, **self.kwargs)


@contextlib.contextmanager
def block_world(train: TrainSpec, device_type: str = "cpu") -> Iterator[DeviceMesh | None]:
    """The mesh a tensor-parallel trial's block is split over: a fake group of its tp_size ranks, this process
    rank 0 (TP ranks hold equal shards); None for the other strategies, whose blocks hold whole weights."""
    if not train.tensor_parallel:
        yield None
        return
    init_fake_world(0, train.tp_size)
    try:
        yield init_device_mesh(device_type, (train.tp_size,))  # built outside any fake mode (it fails inside one)
    finally:
        dist.destroy_process_group()


def block_and_inputs(config: TrialConfig, shape: ModelShape, mode, mesh: DeviceMesh | None = None,
                     device: torch.device = torch.device("cpu")) -> _Block:
    """One decoder block of the trial's model with its techniques applied and its storage created under `mode`
    (a FakeTensorMode: shapes only), in its strategy's arrangement: bf16 weights under FSDP2's mixed precision,
    fp32 weights (a LoRA base in train.lora.base_dtype) under autocast for ddp and tp; under tp and tp_fsdp2 its
    projections split over `mesh` as `tp.block_plan` splits them (FSDP2 gathers a tp_fsdp2 block's TP shards
    before it runs), and under sequence parallelism its input split over the sequence. Inputs as the model passes
    them: hidden states of micro_batch x seq_len, positions, rotary embeddings, no mask (packed batches have
    none). `device`: where the block runs (the rehearsal's fake tensors are CPU ones; tests run real blocks on
    CUDA too)."""
    model, train = unwrapped_model(config)
    dtype = next(model.parameters()).dtype
    block = decoder_blocks(model)[-1]
    rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    sequence_parallel = mesh is not None and train.tp_sequence_parallel(model.config.tie_word_embeddings)
    if mesh is not None:
        parallelize_module(block, mesh, tp.block_plan(block, sequence_parallel))
    with mode:
        block.to_empty(device=device)
        rotary.to_empty(device=device)
        tokens = train.seq_len // mesh.size() if sequence_parallel else train.seq_len
        hidden = torch.randn(train.micro_batch, tokens, shape.hidden_size, dtype=dtype, device=device,
                             requires_grad=True)
        positions = torch.arange(train.seq_len, device=device).unsqueeze(0)
        rope = rotary(hidden, positions)
        if sequence_parallel:  # the embedding's output under sequence parallelism: split over the sequence
            hidden = DTensor.from_local(hidden, mesh, [tp.SEQUENCE])
    kwargs = {"position_ids": positions, "position_embeddings": rope, "attention_mask": None}
    autocast = contextlib.nullcontext if train.fsdp2_sharded else strategies.autocast_for(train, device)
    return _Block(block, hidden, kwargs, autocast)


def _saved_bytes(run, params: nn.Module, mode, kept_by_policy: dict[int, int] | None = None,
                 counted: Callable[[torch.Tensor], bool] = lambda t: True) -> int:
    """Bytes autograd keeps for backward on this rank while `run()` runs its forward (`params`' own storage
    excluded; with `counted`, only the saved tensors it accepts).

    A compiled graph saves what its partitioner chose through its autograd function (`save_for_backward`),
    which the same hooks see, so eager and compiled are counted alike; a DTensor counts its local shard (a
    compiled graph saves the shards themselves). An eager op-level checkpoint keeps its policy's outputs in its
    own cache, unseen by the hooks: `run` reports those in `kept_by_policy` (storage key -> bytes,
    `_policy_block`)."""
    exclude = {key for p in params.parameters() for key in _storages(p)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counted(t):
            saved.update(_storages(t))
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    saved.update(kept_by_policy or {})
    return sum(n for key, n in saved.items() if key not in exclude)


def _partitioned_like_inductor(block: nn.Module, generated_bytes: list[int] | None = None) -> Callable:
    """`block` under torch.compile with inductor's decompositions and partitioner (its joint-graph passes, then
    min-cut rematerialization), so it keeps for backward what the real compile keeps, but with no code
    generated: the partitioned graphs run as they are, on whatever tensors they get (fake ones here).

    The block is captured whole (fullgraph): a graph break would run a checkpointed block eagerly behind
    dynamo's back, and its policy's saved outputs would then go uncounted (a saving that never happens).

    generated_bytes: each graph is also lowered and scheduled by inductor (`_scheduled_bytes`), and what its
    generated kernels would read and write is appended there (forward, then backward when it runs)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def compiler(is_backward: bool):
        def as_is(graph: torch.fx.GraphModule, inputs) -> torch.fx.GraphModule:
            if generated_bytes is not None:
                generated_bytes.append(_scheduled_bytes(graph, inputs, is_backward))
            return graph

        return as_is

    def partition(joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        # Inductor's joint-graph passes read the graph's fake mode from V, which its own compile sets; random ops
        # (LoRA dropout) reach a pass that needs it.
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return partition_fn(joint, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True), partition_fn=partition,
                           decompositions=select_decomp_table())
    return torch.compile(block, backend=backend, fullgraph=True)


def _scheduled_bytes(graph: torch.fx.GraphModule, inputs: list, is_backward: bool) -> int:
    """Bytes the kernels inductor would generate for `graph` read and write: its post-grad passes, lowering and
    scheduler (which fuses), as compile_fx runs them, then no code generated. Matmuls, attention and custom
    operators (Liger's) stay extern kernels and are left out: the roofline prices them as they are.

    Each kernel's count is the scheduler's own (`get_read_write_buffers_sizes`, what inductor's
    `GraphLowering.count_bytes` sums when its metrics log is on)."""
    import copy

    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    graph = copy.deepcopy(graph)  # the passes rewrite it; the caller runs the original
    view_to_reshape(graph)
    with _disable_current_modes(), DebugContext(), V.set_fake_mode(detect_fake_mode(inputs)):
        _recursive_post_grad_passes(graph, is_inference=False)
        lowering = GraphLowering(graph, example_inputs=inputs, is_inference=False, is_backward=is_backward)
        with V.set_graph_handler(lowering):
            lowering.run(*inputs)
            lowering.init_wrapper_code()
            lowering._update_scheduler()
            return sum(node.get_read_write_buffers_sizes() for node in lowering.scheduler.nodes
                       if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)))


def offloaded_block_bytes(config: TrialConfig, shape: ModelShape, offloads: Callable[[torch.Tensor], bool]) -> int:
    """Bytes one decoder block's forward would send to host memory under activation offloading: what autograd saves
    that `offloads` takes (activation_offload.offloads), each storage once, on fake tensors in the strategy's
    arrangement."""
    mode = fake_mode()
    block = block_and_inputs(config, shape, mode)
    with liger_rope(config, shape):
        return _saved_bytes(lambda: block.forward(block.module), block.module, mode, counted=offloads)


def compiled_block_traffic(config: TrialConfig, shape: ModelShape) -> float:
    """What torch.compile's generated kernels move for one decoder block's forward and backward, as a share of
    what its memory-bound operators (FLOP-less, Liger's left out) move eager: the bytes `block_memory_bound_s`
    prices. Both on fake tensors at the trial's micro-batch, sequence length and compute dtype. Inductor fuses
    a norm's or an activation's chain of elementwise operators into one kernel, but an operator between two
    extern kernels (a residual add between a matmul and Liger's norm) it cannot fuse with anything."""
    eager = _MemoryBoundBytes()
    _block_forward_backward(config, shape, lambda block: block, eager)
    generated: list[int] = []
    torch._dynamo.reset()  # this process's compile state before and after stays as the trace left it
    try:
        _block_forward_backward(config, shape, lambda block: _partitioned_like_inductor(block, generated))
    finally:
        torch._dynamo.reset()
    return sum(generated) / eager.bytes


def _block_forward_backward(config: TrialConfig, shape: ModelShape, wrap: Callable,
                            counting: TorchDispatchMode | None = None) -> None:
    """One decoder block's forward and backward on fake tensors, run as `wrap(block)`, `counting` watching both."""
    mode = fake_mode()
    block = block_and_inputs(config, shape, mode)
    run = wrap(block.module)
    counting = counting or contextlib.nullcontext()
    with liger_rope(config, shape), mode:
        with counting:
            out = block.forward(run)
        out = out[0] if isinstance(out, tuple) else out
        grad = torch.ones_like(out)  # outside the count: backward starts from it
        with counting:
            out.backward(grad)


class _MemoryBoundBytes(TorchDispatchMode):
    """Bytes the FLOP-less operators read and write, Liger's left out (as the step tracker's
    block_memory_bound_s counts them, in bytes rather than seconds)."""

    def __init__(self):
        super().__init__()
        self.roofline, self.bytes = Roofline({}, 1.0), 0.0  # a bandwidth of 1 byte/s: seconds are bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, _, moved = self.roofline.cost(func, args, kwargs, out)
        if fusable(func, flops):
            self.bytes += moved
        return out


def compiled_block_saving_gib(config: TrialConfig, shape: ModelShape, op_policy: bool = False) -> float:
    """Activation memory one decoder block keeps for backward run eager, minus what it keeps compiled.

    The eager trace keeps every tensor autograd saves; a compiled block keeps what torch.compile's partitioner
    chose and recomputes the rest (norms, activations, casts) in backward. Each non-checkpointed compiled block
    holds this much less from its forward to its backward (blocks checkpointed whole keep only their input
    either way). op_policy: the block checkpointed with the trial's op-level policy (ac_mode "op"), whose tags
    the partitioner takes as constraints; what it then keeps need not be what the eager policy keeps (on the
    1B sweep's H200 run it was what compile keeps with no checkpointing, to the byte).
    """
    eager, compiled = (_block_kept_bytes(config, shape, run_compiled, op_policy) for run_compiled in (False, True))
    return (eager - compiled) / GIB


def _block_kept_bytes(config: TrialConfig, shape: ModelShape, compiled: bool, op_policy: bool) -> int:
    mode = fake_mode()
    with block_world(config.train) as mesh:
        block = block_and_inputs(config, shape, mode, mesh)
        kept_by_policy: dict[int, int] = {}
        run = _policy_block(block.module, config.train, None if compiled else kept_by_policy) if op_policy \
            else block.module
        torch._dynamo.reset()  # this process's compile state before and after stays as the trace left it
        try:
            run = _partitioned_like_inductor(run) if compiled else run
            with liger_rope(config, shape):
                return _saved_bytes(lambda: block.forward(run), block.module, mode, kept_by_policy)
        finally:
            torch._dynamo.reset()


def _policy_block(block: nn.Module, train: TrainSpec, kept_by_policy: dict[int, int] | None) -> nn.Module:
    """`block` checkpointed with the op-level policy of `train`, as the worker wraps it; the outputs its
    forward keeps go into `kept_by_policy` (storage key -> bytes) when given."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def keep(t: torch.Tensor) -> None:
        kept_by_policy.update(_storages(t))

    on_saved = keep if kept_by_policy is not None else None
    return checkpoint_wrapper(block, context_fn=activation_checkpointing.policy_context_fn(train, on_saved))

