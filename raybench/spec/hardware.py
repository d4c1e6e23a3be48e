"""Facts about accelerators, in one table: device memory, dense peak FLOP/s by compute dtype, memory bandwidth,
measured matmul efficiency, nominal interconnect (NVLink and network links).

Data only (no torch, no I/O). A GPU is found by name fragments that must all appear in its name, first match
first, so the more specific rows come first. Whatever a row leaves out is unknown, never guessed: MFU is null
without a peak, the memory estimate needs `estimate.device_memory_gib` without a memory size.
"""

from __future__ import annotations

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

    @property
    def label(self) -> str:
        return " ".join(self.fragments)


# Vendor data sheets (dense tensor-core figures; fp16 equals bf16 on every part listed; fp8 where the part has FP8
# tensor cores, which the A100 lacks). Memory sizes are what
# nvidia-smi reports (MiB / 1024); the H100 row was checked against one H100 80GB HBM3 (docs/results/).
GPUS: tuple[Gpu, ...] = (
    Gpu(("GB200",), 189471 / 1024, {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0}, 8.0, 0.729, GB200_NVL72),
    Gpu(("B200",), 183359 / 1024, {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}, 8.0, 0.776, HGX_B200),
    Gpu(("H200",), 143771 / 1024, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0}, 4.8, 0.803, HGX_H100),
    Gpu(("H100", "NVL"), 95830 / 1024, {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1670.5}, 3.9, link=HGX_H100),
    Gpu(("H100", "PCIe"), 81559 / 1024, {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0, "fp8": 1513.0}, 2.0,
        link=HGX_H100),
    # SXM, which nvidia-smi names "H100 80GB HBM3"
    Gpu(("H100",), 81559 / 1024, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0}, 3.35, 0.803, HGX_H100),
    Gpu(("A100", "80GB"), 81920 / 1024, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 2.039, 0.869, HGX_A100),  # SXM
    Gpu(("A100", "40GB"), 40536 / 1024, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 1.555, link=HGX_A100),
    # 40 or 80 GB: memory ambiguous
    Gpu(("A100",), None, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, None, link=HGX_A100),
    Gpu(("MI300X",), 192.0, {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4, "fp8": 2614.9}, 5.3),
    Gpu(("L40S",), 46068 / 1024, {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6, "fp8": 733.0}, 0.864),
)


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


def nominal_link(gpu_name: str | None) -> Link | None:
    """A GPU's nominal NVLink and network links; None when the table lacks them."""
    gpu = find_gpu(gpu_name)
    return gpu.link if gpu else None


def known_gpu(gpu_name: str) -> bool:
    return find_gpu(gpu_name) is not None


def gpu_labels() -> list[str]:
    """Names a sweep may give as estimate.gpu (one per table row)."""
    return sorted({gpu.label for gpu in GPUS} | {"H100 SXM"})
