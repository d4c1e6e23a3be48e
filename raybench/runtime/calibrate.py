"""`raybench calibrate`: what the rehearsal's roofline needs to know about one device, measured on it.

Each figure is timed between device synchronizations (CUDA events on a GPU, the wall clock on a CPU) within a
small time budget: the matmul FLOP/s a few GEMM shapes reach (bf16 and fp32), the memory bandwidth a large copy
and an elementwise operator reach, the time one tiny kernel costs, and on CUDA what the caching allocator
reserves over the tensors it holds across a few training steps of a tiny Llama. A GPU's figures are also given
as fractions of the hardware table's peaks (`spec.hardware`); a CPU has no table row, so its absolute figures
define the CPU roofline. Plain data in, plain data out: the CLI derives the rehearsal's constants from it and
the results layer stores it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from raybench.runtime import fingerprint
from raybench.spec.hardware import find_gpu, memory_bandwidth_tb_per_s, peak_tflops

CPU_KEY = "CPU"  # the profile key of a CPU calibration (GPUs are keyed by their hardware-table row)


@dataclass(frozen=True)
class Sizes:
    """What one calibration runs: GEMM shapes (m, n, k) per dtype, the bandwidth buffer, the timing budget."""

    gemms: dict  # dtype name -> tuple of (m, n, k)
    copy_mib: int
    tiny_ops: int
    budget_s: float  # per measurement: repeats stop once this much time is spent (after at least 2)
    allocator_steps: int


FULL_GPU = Sizes({"bf16": ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336), (2048, 2048, 2048)),
                  "fp32": ((4096, 4096, 4096), (8192, 8192, 8192))}, 2048, 2000, 3.0, 4)
QUICK_GPU = Sizes({"bf16": ((4096, 4096, 4096), (8192, 8192, 8192)), "fp32": ((4096, 4096, 4096),)},
                  512, 500, 1.0, 3)
FULL_CPU = Sizes({"bf16": ((512, 512, 512), (1024, 1024, 1024)), "fp32": ((512, 512, 512), (1024, 1024, 1024))},
                 256, 2000, 2.0, 0)
QUICK_CPU = Sizes({"bf16": ((256, 256, 256),), "fp32": ((256, 256, 256), (512, 512, 512))}, 64, 300, 0.4, 0)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda":
        return QUICK_GPU if quick else FULL_GPU
    return QUICK_CPU if quick else FULL_CPU


class _Clock:
    """Seconds of device work between two synchronizations: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def time(self, fn, repeats: int) -> float:
        """Seconds for `repeats` calls of fn, after a synchronization, up to the next one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return time.perf_counter() - t0

    def per_call(self, fn, budget_s: float, calls: int = 1) -> float:
        """Median seconds per call of fn over repeated timings within budget_s (one warm-up call first)."""
        fn()
        samples, spent = [], 0.0
        while len(samples) < 2 or (spent < budget_s and len(samples) < 50):
            seconds = self.time(fn, calls)
            samples.append(seconds / calls)
            spent += seconds
        return statistics.median(samples)


def matmul(device: torch.device, sizes: Sizes, clock: _Clock) -> list[dict]:
    """Achieved FLOP/s of each GEMM shape; on a GPU of the table also as a fraction of its dense peak."""
    gpu = _gpu_name(device)
    found = []
    for name, shapes in sizes.gemms.items():
        dtype = DTYPES[name]
        for m, n, k in shapes:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            seconds = clock.per_call(lambda a=a, b=b: torch.mm(a, b), sizes.budget_s / len(shapes))
            flops = 2 * m * n * k / seconds
            peak = peak_tflops(gpu, name) if gpu else None
            found.append({"dtype": name, "shape": [m, n, k], "seconds": seconds, "flop_per_s": flops,
                          "fraction_of_peak": flops / (peak * 1e12) if peak else None,
                          # fp32 matmuls on tensor cores (TF32) can pass the table's fp32 peak: say when allowed
                          "tf32": name == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32})
    return found


def bandwidth(device: torch.device, sizes: Sizes, clock: _Clock) -> list[dict]:
    """Achieved bytes/s of a large copy (read + write) and of an elementwise add (two reads, one write)."""
    gpu = _gpu_name(device)
    table = memory_bandwidth_tb_per_s(gpu) if gpu else None
    n = sizes.copy_mib * 2**20 // 4
    x, y, out = (torch.empty(n, device=device, dtype=torch.float32).fill_(1.0) for _ in range(3))
    found = []
    for kind, fn, moved in (("copy", lambda: out.copy_(x), 2 * n * 4),
                            ("elementwise add", lambda: torch.add(x, y, out=out), 3 * n * 4)):
        seconds = clock.per_call(fn, sizes.budget_s / 2)
        found.append({"kind": kind, "bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds,
                      "fraction_of_peak": moved / seconds / (table * 1e12) if table else None})
    return found


def launch_cost(device: torch.device, sizes: Sizes, clock: _Clock) -> float:
    """Seconds per tiny operator: many one-element adds between two synchronizations (dispatch and launch, no
    work)."""
    x = torch.zeros(1, device=device)
    return clock.per_call(lambda: x.add_(1.0), sizes.budget_s / 2, calls=sizes.tiny_ops)


def allocator_reserve(device: torch.device, sizes: Sizes) -> tuple[float, str]:
    """What torch's caching allocator reserves over what its tensors hold (peak reserved / peak allocated) across
    a few training steps of a tiny Llama built from a config (no download); 1.0 on a CPU, which has no caching
    allocator."""
    if device.type != "cuda":
        return 1.0, "CPU: no caching allocator, reserve 1.0 (the process's RSS is what CPU rows report)"
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(sizes.allocator_steps):
        ids = torch.randint(0, config.vocab_size, (4, 512 + 128 * step), device=device)  # shapes vary a little
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    reserve = torch.cuda.max_memory_reserved(device) / torch.cuda.max_memory_allocated(device)
    del model, optimizer
    torch.cuda.empty_cache()
    return reserve, (f"peak reserved / peak allocated over {sizes.allocator_steps} AdamW steps of a 4-layer Llama "
                     "(hidden 1024, bf16, batch 4, 512-896 tokens)")


def collectives(device: torch.device) -> dict:
    """All-reduce bus bandwidth between the visible GPUs: not measured by this one process (it needs one process
    per GPU); every multi-rank sweep measures it with its trials (`runtime.allreduce`), and the rehearsal uses the
    stored probe of the cluster, else nominal links."""
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count < 2:
        return {"devices": count, "busbw_gbps": None, "note": "one device: no collective to measure"}
    return {"devices": count, "busbw_gbps": None,
            "note": f"{count} GPUs visible: all-reduce bus bandwidth not measured here (it needs one process per "
                    "GPU); the all-reduce probe of any multi-rank sweep measures and stores it"}


def device_fingerprint(device: torch.device) -> dict:
    """The device as the profile is keyed: its hardware-table row (CPU_KEY on a CPU), name, count, versions."""
    hw, sw = fingerprint.hardware(device), fingerprint.software()
    name = hw["gpu_name"]
    row = find_gpu(name) if name else None
    return {"key": (row.label if row else name) if name else CPU_KEY, "device_type": device.type,
            "device_name": name or hw["cpu_model"], "table_row": row.label if row else None,
            "device_count": hw["gpu_count"] if name else 1, "cpu_model": hw["cpu_model"], "cpu_count": hw["cpu_count"],
            "torch_version": sw["torch_version"], "cuda_version": sw["cuda_version"], "hostname": hw["hostname"]}


def measure(device: torch.device, quick: bool = False, progress=None) -> dict:
    """Every measurement on `device`, as plain data: fingerprint, figures, each figure's notes, duration."""
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    sizes, clock = sizes_for(device, quick), _Clock(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fp = device_fingerprint(device)
    say(f"calibrating {fp['device_name']} ({fp['key']}){' --quick' if quick else ''}")
    gemms = matmul(device, sizes, clock)
    say(f"  matmul: {len(gemms)} shapes")
    moved = bandwidth(device, sizes, clock)
    say("  bandwidth: copy, elementwise")
    launch_s = launch_cost(device, sizes, clock)
    reserve, reserve_note = allocator_reserve(device, sizes)
    comm = collectives(device)
    peaks = {name: max(g["flop_per_s"] for g in gemms if g["dtype"] == name) for name in sizes.gemms}
    fractions = {name: _median(g["fraction_of_peak"] for g in gemms if g["dtype"] == name) for name in sizes.gemms}
    return {
        "fingerprint": fp, "quick": quick,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "matmul": gemms, "bandwidth": moved,
        "matmul_flop_per_s": peaks,  # the best shape per dtype: a CPU roofline's peaks
        "matmul_fraction": fractions,  # median over shapes, of the table's peak (None without a table peak)
        "bandwidth_bytes_per_s": max(b["bytes_per_s"] for b in moved),
        "bandwidth_fraction": _median(b["fraction_of_peak"] for b in moved),
        "launch_s": launch_s, "allocator_reserve": reserve, "allocator_note": reserve_note,
        "collectives": comm,
        "duration_s": time.perf_counter() - t0,
    }


def _median(values) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
