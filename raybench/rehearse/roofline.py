"""One operator's cost on a GPU of the hardware table: FLOPs at its peak FLOP/s, bytes at its memory bandwidth."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from raybench.rehearse.fitted import ROOFLINE_REFERENCE_GPU, SHIPPED_CALIBRATION, Calibration
from raybench.runtime.techniques import liger_reference
from raybench.spec.hardware import attention_share, matmul_efficiency, memory_bandwidth_tb_per_s, peak_tflops


def flop_formulas() -> dict:
    """Operator → FLOP formula: torch's flop counter registry, plus the CPU flash-attention kernels (which
    the CPU trace dispatches to) mapped to the CUDA flash formulas they mirror."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas = dict(flop_registry)
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention]
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward_flop
    return formulas


def _cpu_flash_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def attention_kernels() -> dict:
    """Flash-attention operators (the CUDA ones and the CPU ones the trace dispatches to) -> (is backward, the
    position of the query among their arguments)."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention: (False, 0),
            aten._scaled_dot_product_flash_attention_for_cpu: (False, 0),
            aten._scaled_dot_product_flash_attention_backward: (True, 1),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: (True, 1)}


def _not_memory_traffic() -> set:
    """Operators that move no data worth counting: torch's runtime estimator's lists (views, metadata, RNG
    seeds), and allocations (an empty tensor is reserved, not written)."""
    from torch.utils._runtime_estimation import _IGNORE_OPS, _VIEW_OPS

    aten = torch.ops.aten
    allocations = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
    return set(_IGNORE_OPS) | set(_VIEW_OPS) | allocations


class OpCost(NamedTuple):
    """One operator's roofline cost: FLOPs, seconds at peak FLOP/s, seconds at the memory bandwidth, and whether
    it runs a kernel on a GPU."""

    flops: float
    compute_s: float
    memory_s: float
    launches: bool


class Roofline:
    """One operator's roofline cost on a GPU: FLOPs / peak FLOP/s of its output dtype and bytes moved / memory
    bandwidth (the step tracker sums them; the SAC estimator takes them per operator)."""

    def __init__(self, peaks: dict, bandwidth: float | None, gpu: str | None = None):
        self.peaks, self.bandwidth = peaks, bandwidth  # FLOP/s by dtype; bytes/s
        self.gpu = gpu  # the hardware table's row, for its attention kernel's rates (None: priced as matmuls)
        self.formulas, self.skip_traffic = flop_formulas(), _not_memory_traffic()
        self.attention = attention_kernels()

    def launches_kernel(self, func, out) -> bool:
        """Whether the operator runs a kernel on a GPU: it writes data (views, metadata and allocations do not; an
        operator that neither returns a tensor nor writes one, such as prim.device or a size query, reads
        metadata)."""
        writes = func._schema.is_mutable or any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
        return func._overloadpacket not in self.skip_traffic and not func.is_view and writes

    def cost(self, func, args, kwargs, out) -> tuple[float, float, float]:
        """(FLOPs, seconds at peak FLOP/s, seconds at the memory bandwidth)."""
        return self.op_cost(func, args, kwargs, out)[:3]

    def op_cost(self, func, args, kwargs, out) -> OpCost:
        """The operator's cost and whether it launches a kernel (`launches_kernel`), each worked out once."""
        packet = func._overloadpacket
        flops = compute_s = 0.0
        if packet in self.formulas:
            flops = float(self.formulas[packet](*args, **kwargs, out_val=out))
            if is_causal(func, args, kwargs):
                flops /= 2  # causal kernels skip the masked half of the score matrix
        if flops:  # the peak by dtype only where there are FLOPs to price (most operators have none)
            dtype = fp8_input(args) or next(
                (t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            peak = (self.peaks.get(dtype) or 0.0) * self.attention_share(packet, args)
            compute_s = flops / peak if peak else 0.0
        launches = self.launches_kernel(func, out)
        moved = 0
        if launches:
            moved = sum(tensor_bytes(t) for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return OpCost(flops, compute_s, moved / self.bandwidth if self.bandwidth else 0.0, launches)

    def attention_share(self, packet, args) -> float:
        """The share of the matmul rate a flash-attention operator runs at on this GPU, by its sequence length and
        head dim, forward or backward (hardware.attention_share: the kernel's published rates); 1 for any other
        operator."""
        if packet not in self.attention:
            return 1.0
        backward, position = self.attention[packet]
        *_, seq_len, head_dim = args[position].shape
        return attention_share(self.gpu, seq_len, head_dim, backward)


def is_causal(func, args, kwargs) -> bool:
    """Whether an attention operator runs causal: its `is_causal` argument, wherever its schema puts it (the
    flash forward's fifth argument, the backward's eighth)."""
    if "is_causal" in kwargs:
        return kwargs["is_causal"] is True
    names = [argument.name for argument in func._schema.arguments]
    position = names.index("is_causal") if "is_causal" in names else None
    return position is not None and position < len(args) and args[position] is True


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _data(t: torch.Tensor) -> torch.Tensor:
    """What a tensor's kernel reads: torchao's Float8TrainingTensor (train.fp8) wraps float8 `_data` in a tensor
    of its original dtype; any other tensor is itself."""
    inner = getattr(t, "_data", None)
    return inner if isinstance(inner, torch.Tensor) and inner.dtype in FLOAT8 else t


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a kernel reads or writes of tensor `t` (a scalar: its storage's)."""
    data = _data(t)
    return data.untyped_storage().nbytes() if data.dim() == 0 else data.numel() * data.element_size()


def fp8_input(args) -> torch.dtype | None:
    """The float8 dtype an operator multiplies in, where its inputs are FP8 (the matmul then runs on the FP8
    tensor cores, at their peak, whatever dtype it returns); None otherwise."""
    return next((_data(t).dtype for t in pytree.tree_leaves(args)
                 if isinstance(t, torch.Tensor) and _data(t).dtype in FLOAT8), None)


def gpu_roofline(gpu: str | None, calibration: Calibration = SHIPPED_CALIBRATION) -> Roofline:
    """The roofline of raybench's hardware table for `gpu` (no GPU: every operator costs 0 s); matmuls on FP8
    inputs run at the table's FP8 peak (`fp8_input`), with the same efficiency as bf16's. With the shipped
    constants its tensor-core peaks are scaled by the GPU's measured matmul efficiency relative to the GPU
    ROOFLINE_EFFICIENCY was fitted on (`matmul_efficiency_ratio`); a calibration profile measured its own. Bytes
    are priced at bandwidth_fraction / efficiency of the bandwidth (1 with the shipped constants), so that over
    the step's efficiency they run at the calibrated fraction. A profile with absolute peaks (a CPU's, or a GPU
    the table lacks) is the roofline itself."""
    dtypes = ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"),
              *((dtype, "fp8") for dtype in FLOAT8))
    byte_scale = calibration.bandwidth_fraction / calibration.efficiency
    if calibration.peaks:  # a profile measures bf16 and fp32; fp16 and fp8 run at bf16's (no FP8 cores measured)
        known = calibration.peaks
        peaks = {dtype: known.get(name, known.get("bf16" if name in ("fp16", "fp8") else name, 0.0))
                 for dtype, name in dtypes}
        return Roofline(peaks, (calibration.bandwidth or 0) * byte_scale or None)
    ratio = 1.0 if calibration.profiled else matmul_efficiency_ratio(gpu)
    peaks = {dtype: (peak_tflops(gpu, name) or 0) * 1e12 * (ratio if name != "fp32" else 1.0)
             for dtype, name in dtypes} if gpu else {}
    bandwidth = (memory_bandwidth_tb_per_s(gpu) or 0) * 1e12 * byte_scale or None
    return Roofline(peaks, bandwidth, gpu)


def matmul_efficiency_ratio(gpu: str | None) -> float:
    """How much more of its bf16 peak a GPU's matmuls reach than the H100 SXM's (1 when either is unmeasured):
    ROOFLINE_EFFICIENCY holds for the H100, and a GB200 reaches 0.729 of its peak where an H100 reaches 0.803."""
    own, reference = matmul_efficiency(gpu), matmul_efficiency(ROOFLINE_REFERENCE_GPU)
    return own / reference if own and reference else 1.0



def fusable(func, flops: float) -> bool:
    """A memory-bound operator torch.compile fuses: no FLOPs (matmuls and attention have theirs), and not one of
    Liger's kernels (fused already, and opaque to compile like matmuls and attention)."""
    return not flops and func.namespace != liger_reference.NAMESPACE

