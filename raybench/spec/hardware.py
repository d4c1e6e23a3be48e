"""Facts about accelerators, in one table: device memory, dense peak FLOP/s by compute dtype, memory bandwidth,
measured matmul efficiency, nominal interconnect (NVLink and network links).

Data only (no torch, no I/O). A GPU is found by name fragments that must all appear in its name, first match
first, so the more specific rows come first. Whatever a row leaves out is unknown, never guessed: MFU is null
without a peak, the memory estimate needs `estimate.device_memory_gib` without a memory size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    """Nominal links of one GPU, GB/s in each direction (vendor data sheets)."""

    nvlink_gbps: float  # NVLink, between the GPUs of one NVLink domain
    nic_gbps: float  # its network adapter (one per GPU) to the GPUs beyond the domain
    nvlink_gpus: int  # GPUs in one NVLink domain: 8 in an HGX node, 72 in a GB200 NVL72 rack


# Used by the rehearsal's step time when the cluster has no stored all-reduce probe. H100/H200 SXM: NVLink 4,
# 900 GB/s bidirectional (450 each way), one 400 Gb/s NDR NIC per GPU (50 GB/s). A100 SXM: NVLink 3, 600 GB/s
# (300 each way), one 200 Gb/s HDR NIC per GPU (25 GB/s). B200: NVLink 5, 1.8 TB/s (900 each way), 400 Gb/s per
# GPU. Eight GPUs to an NVLink domain, except GB200 NVL72, whose NVLink switches join the 72 GPUs of a rack (18
# trays of 4). Every H100 row (PCIe and NVL included) and every A100 row carries its SXM part's links.
GB200_NVL72 = Link(900.0, 50.0, 72)
HGX_B200 = Link(900.0, 50.0, 8)
HGX_H100 = Link(450.0, 50.0, 8)  # H200 too
HGX_A100 = Link(300.0, 25.0, 8)


@dataclass(frozen=True)
class AttentionKernel:
    """Published TFLOP/s of the flash-attention kernel a GPU's SDPA runs, forward and backward apart, by head dim
    and sequence length, with the best matmul TFLOP/s of the GPU they were measured on: a kernel's rate over that
    matmul rate is the share of the matmul rate attention reaches (`attention_share`)."""

    source: str
    seq_lens: tuple[int, ...]
    forward_tflops: dict[int, tuple[float, ...]]  # head dim -> TFLOP/s at each of seq_lens
    backward_tflops: dict[int, tuple[float, ...]]
    matmul_tflops: float  # the measuring GPU's best bf16 matmul TFLOP/s (MAMF)


# FlashAttention-2, the kernel PyTorch's SDPA flash backend ships, on an H100 80GB SXM5 in bf16, batch x seq 16k,
# hidden 2048 (FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608, Figures 5 and 6, the FlashAttention-2
# bars; published, not measured here). Forward, head dim 128: the causal chart. Forward, head dim 64: the paper
# charts it without the causal mask only (282, 306, 318, 321, 322, 324), scaled at each length by head dim 128's
# causal/non-causal ratio (191/309 ... 335/370). Backward: the paper's charts (no causal mask). FlashAttention-2
# does not use Hopper's asynchronous tensor-core instructions, so on an H100 it reaches 24-42% of the part's
# measured matmul rate (794.5 TFLOP/s), where on an A100 it reaches 73% of the peak forward (the FA2 paper).
FA2_HOPPER = AttentionKernel(
    source="FlashAttention-2 on H100 SXM5 (FlashAttention-3 paper, Figures 5-6)",
    seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
    forward_tflops={64: (174.0, 227.0, 262.0, 278.0, 290.0, 293.0), 128: (191.0, 260.0, 298.0, 319.0, 333.0, 335.0)},
    backward_tflops={64: (198.0, 238.0, 264.0, 279.0, 287.0, 291.0), 128: (214.0, 260.0, 291.0, 310.0, 318.0, 322.0)},
    matmul_tflops=794.5)


def power_capped(peaks: dict[str, float], rated_w: float, limit_w: float) -> dict[str, float]:
    """Dense peaks of a part held to limit_w below the board power rated_w its data-sheet clocks are quoted at.

    A GPU's dynamic power is about C x V^2 x f and its voltage rises with its clock along the DVFS curve, so power
    grows about as f^3 and the clock a capped part sustains, and its peaks with it, as (limit_w / rated_w)^(1/3):
    an H100 SXM (700 W) held to 500 W, 0.894 of its clocks. A model of the silicon (the CMOS power relation), not a
    measurement; a `raybench calibrate` profile measured on the part replaces it."""
    clock_ratio = min(1.0, limit_w / rated_w) ** (1 / 3)
    return {dtype: tflops * clock_ratio for dtype, tflops in peaks.items()}


H100_SXM_PEAKS = {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0}  # at 700 W


@dataclass(frozen=True)
class Gpu:
    fragments: tuple[str, ...]  # all must appear in the GPU's name (case-insensitive)
    memory_gib: float | None = None  # memory.total as nvidia-smi (or torch) reports it
    peak_tflops: dict[str, float] = field(default_factory=dict)  # dense (no sparsity), per compute dtype
    memory_bandwidth_tb_per_s: float | None = None  # HBM/GDDR bandwidth from the vendor's data sheet
    # Best bf16 matmul throughput measured on the part over its dense bf16 peak ("maximum achievable matmul
    # FLOPS", the public MAMF table of Stas Bekman's ML Engineering book, measured with mamf-finder.py: A100 SXM
    # 271.2/312, H100 SXM 794.5/989, H200 "the same", B200 1745/2250, GB200 1822/2500). None: not measured.
    matmul_efficiency: float | None = None
    link: Link | None = None  # None: links unknown (no nominal bus bandwidth)
    # The flash-attention kernel's published rates on this part's architecture; None: attention priced as matmuls
    attention: AttentionKernel | None = None

    @property
    def label(self) -> str:
        return " ".join(self.fragments)


# Vendor data sheets (dense tensor-core figures; fp16 equals bf16 on every part listed; fp8 where the part has FP8
# tensor cores, which the A100 lacks). Memory sizes are what
# nvidia-smi reports (MiB / 1024); the H100 row was checked against one H100 80GB HBM3 (docs/results/).
GPUS: tuple[Gpu, ...] = (
    Gpu(("GB200",), 189471 / 1024, {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0}, 8.0, 0.729, GB200_NVL72),
    Gpu(("B200",), 183359 / 1024, {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}, 8.0, 0.776, HGX_B200),
    Gpu(("H200",), 143771 / 1024, H100_SXM_PEAKS, 4.8, 0.803, HGX_H100, FA2_HOPPER),
    Gpu(("H100", "NVL"), 95830 / 1024, {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1670.5}, 3.9, link=HGX_H100,
        attention=FA2_HOPPER),
    Gpu(("H100", "PCIe"), 81559 / 1024, {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0, "fp8": 1513.0}, 2.0,
        link=HGX_H100, attention=FA2_HOPPER),
    # The H100 with 96 GB of HBM2e (2.4 TB/s) run at a 500 W power limit, as torchtitan's 2024-12 H100 benchmark
    # ran it (benchmarks/llama3_h100_202412_torchtitan.md): the SXM part's SMs at the clocks 500 W sustains
    # (`power_capped`). The memory nvidia-smi reports for it is not published: None.
    Gpu(("H100", "HBM2e"), None, power_capped(H100_SXM_PEAKS, 700.0, 500.0), 2.4, 0.803, HGX_H100, FA2_HOPPER),
    # SXM, which nvidia-smi names "H100 80GB HBM3"
    Gpu(("H100",), 81559 / 1024, H100_SXM_PEAKS, 3.35, 0.803, HGX_H100, FA2_HOPPER),
    Gpu(("A100", "80GB"), 81920 / 1024, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 2.039, 0.869, HGX_A100),  # SXM
    Gpu(("A100", "40GB"), 40536 / 1024, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 1.555, link=HGX_A100),
    # 40 or 80 GB: memory ambiguous
    Gpu(("A100",), None, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, None, link=HGX_A100),
    Gpu(("MI300X",), 192.0, {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4, "fp8": 2614.9}, 5.3),
    Gpu(("L40S",), 46068 / 1024, {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6, "fp8": 733.0}, 0.864),
)


# The host link one GPU copies to and from host memory over, GB/s per direction, nominal (the bus's data sheet):
# PCIe Gen5 x16 for Hopper and Blackwell boards, Gen4 x16 for the A100, NVLink-C2C to the Grace CPU for the GB200.
# First match of the GPU's name wins (as find_gpu's rows); None: unknown.
HOST_LINK_GB_PER_S = (("GB200", 450.0), ("B200", 64.0), ("H200", 64.0), ("H100", 64.0), ("A100", 32.0),
                      ("MI300X", 64.0), ("L40S", 32.0))


def host_link_gb_per_s(gpu_name: str | None) -> float | None:
    """GB/s one GPU copies to or from host memory at, per direction, nominal; None when unknown."""
    if not gpu_name:
        return None
    return next((gbps for fragment, gbps in HOST_LINK_GB_PER_S if fragment.lower() in gpu_name.lower()), None)


def find_gpu(name: str | None) -> Gpu | None:
    """The table's row for a GPU named like 'H100 SXM' or 'NVIDIA A100-SXM4-80GB'; None when none matches."""
    if not name:
        return None
    lowered = name.lower()
    return next((gpu for gpu in GPUS if all(f.lower() in lowered for f in gpu.fragments)), None)


def peak_tflops(gpu_name: str | None, precision: str) -> float | None:
    """Dense peak TFLOP/s of one GPU for a compute dtype (bf16, fp16, fp32, fp8); None when unknown."""
    gpu = find_gpu(gpu_name)
    return gpu.peak_tflops.get(precision) if gpu else None


def gpu_memory_gib(gpu_name: str | None) -> float | None:
    """Device memory of one GPU in GiB; None when the table lacks it."""
    gpu = find_gpu(gpu_name)
    return gpu.memory_gib if gpu else None


def memory_bandwidth_tb_per_s(gpu_name: str | None) -> float | None:
    gpu = find_gpu(gpu_name)
    return gpu.memory_bandwidth_tb_per_s if gpu else None


def matmul_efficiency(gpu_name: str | None) -> float | None:
    gpu = find_gpu(gpu_name)
    return gpu.matmul_efficiency if gpu else None


def attention_share(gpu_name: str | None, seq_len: int, head_dim: int, backward: bool) -> float:
    """The share of its matmul rate a GPU's flash-attention kernel reaches at this sequence length and head dim
    (the nearest head dim the kernel's table has; lengths between two of its lengths interpolated in log2, beyond
    its ends held at the end's figure); 1 for a GPU whose kernel the table lacks (attention priced as matmuls)."""
    gpu = find_gpu(gpu_name)
    kernel = gpu.attention if gpu else None
    if kernel is None:
        return 1.0
    rates = kernel.backward_tflops if backward else kernel.forward_tflops
    nearest = min(rates, key=lambda dim: (abs(dim - head_dim), -dim))
    import numpy as np  # here, as spec.tokenized_data does: the spec layer imports light

    # numpy's interp holds the ends' figures beyond them
    rate = float(np.interp(math.log2(seq_len), np.log2(kernel.seq_lens), rates[nearest]))
    return min(1.0, rate / kernel.matmul_tflops)


def nominal_link(gpu_name: str | None) -> Link | None:
    """A GPU's nominal NVLink and network links; None when the table lacks them."""
    gpu = find_gpu(gpu_name)
    return gpu.link if gpu else None


def known_gpu(gpu_name: str) -> bool:
    return find_gpu(gpu_name) is not None


def gpu_labels() -> list[str]:
    """Names a sweep may give as estimate.gpu (one per table row)."""
    return sorted({gpu.label for gpu in GPUS} | {"H100 SXM"})
