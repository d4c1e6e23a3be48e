"""The constants of the rehearsal fitted on GPU measurements; every other figure of a prediction comes from the
trace and the hardware table. A device `raybench calibrate` measured replaces them with its profile
(`Calibration`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raybench.results.profiles import CPU_KEY
from raybench.spec.finetunes import Finetune

# Achieved fraction of the per-operator roofline (peak FLOP/s and memory bandwidth) on an H100 SXM, the median
# of roofline / measured step time over the 10 eager rows of the committed 1B sAC sweep
# (docs/results/gpu-2026-11-22/gpu-sac-1b.parquet): 0.7048, range 0.67-0.72 (docs/results/rehearse-2026-11-25.md).
# Other GPUs get the same fraction of their own roofline, with tensor-core peaks scaled by their measured matmul
# efficiency relative to this GPU's (`matmul_efficiency_ratio`; the hardware table's public MAMF figures).
ROOFLINE_EFFICIENCY = 0.70
ROOFLINE_REFERENCE_GPU = "H100 SXM"
# The caching allocator reserves more than the tensors it holds (block rounding, fragmentation), and GPU rows
# report the reserved peak. Fitted the same way: median peak_reserved_gib / peak_alloc_gib over the same 10
# rows, 1.159 (range 1.12-1.23). A GPU rehearsal's reserved_gib is its tensor peak times this.
ALLOCATOR_RESERVE = 1.16
# A frozen base (LoRA, QLoRA) reserves less over its tensors: no weight gradients, no optimizer step's buffers
# between the activations. Fitted the same way on the five LoRA rows of the H200 speed round
# (docs/results/gpu-2026-11-28-h200/gpu-speed-1gpu.parquet): median 1.058 (range 1.02-1.06); checked on the H100's
# held-out LoRA and QLoRA rows (docs/results/reserve-frozen-base-2026-11-29.md).
ALLOCATOR_RESERVE_FROZEN_BASE = 1.06
# torch.compile (not traced: compiled trials trace eager) fuses the elementwise, reduction and copy operators
# of each compiled decoder block into generated kernels; how many bytes those move, against the eager
# operators', inductor itself counts on one block (compiled_block_traffic). A byte its kernels move costs this
# many times a byte of the eager operators' roofline. Fitted like the two above on the 10 compiled rows of the
# same sweep (docs/results/rehearse-2026-11-26.md, section 5).
COMPILED_BYTE_COST = 1.26


SHIPPED = "shipped H100 constants"


@dataclass(frozen=True)
class Calibration:
    """What prices a rehearsal on one device: the shipped constants above, or a profile `raybench calibrate`
    measured on that device (`from_profile`). The roofline prices FLOPs at the table's peak (x matmul_ratio:
    the shipped `matmul_efficiency_ratio`, 1 for a profile, which measured its own matmuls) and bytes at the
    table's bandwidth x bandwidth_fraction / efficiency; the step divides the roofline by efficiency, so FLOPs
    run at `efficiency` of the peak and bytes at `bandwidth_fraction` of the bandwidth. A device without a
    table row (a CPU) is priced at the profile's absolute `peaks` and `bandwidth` instead."""

    efficiency: float = ROOFLINE_EFFICIENCY
    bandwidth_fraction: float = ROOFLINE_EFFICIENCY  # the shipped constant prices bytes like FLOPs
    reserve: float = ALLOCATOR_RESERVE  # the reserve a rehearsal prices with (`for_finetune` picks it per trial)
    frozen_base_reserve: float = ALLOCATOR_RESERVE_FROZEN_BASE
    launch_s: float | None = None  # measured, recorded; not priced (the fitted efficiency carries launch gaps)
    source: str = SHIPPED  # how rows name it: "shipped H100 constants" or "profile: <device> <date>"
    peaks: dict | None = None  # FLOP/s by dtype name ("bf16", "fp32"), for a device the table lacks
    bandwidth: float | None = None  # bytes/s, likewise

    @property
    def profiled(self) -> bool:
        return self.source != SHIPPED

    def for_finetune(self, tuning: Finetune) -> Calibration:
        """This calibration with the reserve of a trial that trains as `tuning` does (train.tuning): a frozen
        base's where it trains adapters (LoRA, QLoRA)."""
        return dataclasses.replace(self, reserve=self.frozen_base_reserve) if tuning.adapters else self

    @classmethod
    def from_profile(cls, profile: dict) -> Calibration:
        """The calibration a stored profile gives: derived anew from its measured figures, so that a profile
        stored before a change of `derive` prices as a fresh one would."""
        d = derive(profile)
        return cls(efficiency=d["efficiency"], bandwidth_fraction=d["bandwidth_fraction"], reserve=d["reserve"],
                   frozen_base_reserve=d["frozen_base_reserve"], launch_s=d.get("launch_s"),
                   source=f"profile: {profile['fingerprint']['key']} {profile['date']}",
                   peaks=d.get("peaks_flop_per_s"), bandwidth=d.get("bandwidth_bytes_per_s"))

    @classmethod
    def of(cls, rehearsal: dict) -> Calibration:
        """The calibration a stored rehearsal was priced with (the shipped constants for one stored before
        rehearsals kept it)."""
        return cls(**rehearsal["calibration"]) if rehearsal.get("calibration") else cls()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


SHIPPED_CALIBRATION = Calibration()


def step_share() -> float:
    """The share of its matmul rate the H100's step reached: ROOFLINE_EFFICIENCY over the H100's measured
    matmul efficiency (the hardware table's MAMF figure, 0.803), 0.872. It covers what a calibration's kernels
    do not see (launch gaps, small and fused shapes) and is kept for every profile."""
    from raybench.spec.hardware import matmul_efficiency

    return ROOFLINE_EFFICIENCY / matmul_efficiency(ROOFLINE_REFERENCE_GPU)


def derive(measured: dict) -> dict:
    """The rehearsal's constants from one calibration's figures (runtime.calibrate.measure): FLOPs at the
    measured bf16 matmul fraction of the table's peak x step_share(), bytes at the measured bandwidth fraction x
    step_share(), the reserve (_reserve). A device without table peaks (a CPU) is its own roofline: its
    best measured FLOP/s and bytes/s are the peaks, at fraction 1."""
    share = step_share()
    matmul = measured["matmul_fraction"].get("bf16")
    moved = measured["bandwidth_fraction"]
    absolute = matmul is None or moved is None
    return {"efficiency": (1.0 if absolute else matmul) * share,
            "bandwidth_fraction": (1.0 if absolute else moved) * share,
            "reserve": _reserve(measured, ALLOCATOR_RESERVE),
            "frozen_base_reserve": _reserve(measured, ALLOCATOR_RESERVE_FROZEN_BASE),
            "launch_s": measured["launch_s"], "step_share": share,
            "peaks_flop_per_s": dict(measured["matmul_flop_per_s"]) if absolute else None,
            "bandwidth_bytes_per_s": measured["bandwidth_bytes_per_s"] if absolute else None}


def _reserve(measured: dict, fitted: float) -> float:
    """The reserve a profile prices with: a CPU's measured 1.0 (no caching allocator), else the `fitted` one.
    A GPU's measured reserve is recorded, not priced: on an H100 (2026-11-28) the small Llama `calibrate` steps
    made the allocator reserve 1.85x its tensors where the 1B rows reserve 1.16x, and priced with it the held-out
    rows' reserved peaks came out +59% (docs/results/gpu-2026-11-28-h100.md): a small model's blocks round up
    more, so the reserve fitted on training steps of the size users rehearse is kept."""
    on_cpu = measured.get("fingerprint", {}).get("key") == CPU_KEY
    return measured["allocator_reserve"] if on_cpu else fitted


def measure_profile(kind: str, quick: bool, command: str, progress=None) -> dict:
    """A device profile as `raybench calibrate` stores it: runtime.calibrate's measurements on the current `kind`
    device ("cuda" or "cpu"), the constants `derive` gets from them, the command that measured and how long it
    took."""
    import time

    import torch

    from raybench.runtime import calibrate

    t0 = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    measured = calibrate.measure(device, quick=quick, progress=progress)
    profile = {**measured, "derived": derive(measured), "command": command}
    profile["duration_s"] = time.perf_counter() - t0
    return profile
