"""A store of planted result rows: two GPU systems that differ in known ways, plus a CPU system and failures.

The rows are real trial rows (plan → build_row → store.write_row); only their measurements are made up, so
reports, compare and export read exactly what a sweep would have written.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from fractions import Fraction
from pathlib import Path

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult

SWEEP = "planted"
# What separates the two GPU systems (seed 000's finding, plus an interconnect and a library version).
GPU_SYSTEMS = {
    "della": {"gpu_mem_clock_max_mhz": 2619.0, "gpu_topology": "GPU0\tX\tNV18\nGPU1\tNV18\tX",
              "nccl_version": "2.27.3", "allreduce_busbw_gbps": 180.0, "speed": 1.15,
              "efficiency": {1: 1.0, 2: 0.95, 4: 0.93}},
    "snellius": {"gpu_mem_clock_max_mhz": 1593.0, "gpu_topology": "GPU0\tX\tPIX\nGPU1\tPIX\tX",
                 "nccl_version": "2.26.2", "allreduce_busbw_gbps": 24.0, "speed": 1.0,
                 "efficiency": {1: 1.0, 2: 0.85, 4: 0.75}},
}
SAME = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_power_limit_w": 700.0, "torch_version": "2.13.0",
        "device_type": "cuda", "gpu_memory_gib": 79.6, "cpu_model": "AMD EPYC 9334"}
WORKERS = [1, 2, 4]
AC_RATIOS = ["0", "1/2", "1"]
REPEATS = 2


def _trials(name: str = SWEEP):
    spec = parse_sweep({"name": name, "model": {"preset": "tiny"}, "repeats": REPEATS,
                        "axes": {"resources.workers": WORKERS, "train.ac_ratio": AC_RATIOS}})
    return plan(spec)


def gpu_metrics(system: str, workers: int, ac_ratio: str, repeat: int) -> dict:
    ac = float(Fraction(ac_ratio))
    efficiency = GPU_SYSTEMS[system]["efficiency"][workers]
    tok = 3000.0 * GPU_SYSTEMS[system]["speed"] * (1 - 0.25 * ac) * efficiency * (1 + 0.01 * repeat)
    step_s = 6 * 2048 / tok
    fixed = {k: v for k, v in GPU_SYSTEMS[system].items() if k not in ("speed", "efficiency")}
    return {
        **SAME, **fixed, "system": system, "hostname": f"{system}-gpu01",
        "tok_per_s_per_device": tok, "tok_per_s": tok * workers, "step_time_p50_s": step_s,
        "step_time_p90_s": step_s * 1.05, "mfu": 0.3 * GPU_SYSTEMS[system]["speed"] * (1 - 0.25 * ac),
        "peak_reserved_gib": 60.0 - 30.0 * ac, "peak_rss_gib": 12.0, "loss_first": 10.0, "loss_final": 9.5,
        "phase_data_mean_s": 0.01 * step_s, "phase_forward_mean_s": 0.3 * step_s,
        "phase_backward_mean_s": 0.6 * step_s, "phase_optimizer_mean_s": 0.09 * step_s,
        "weights_cache": "hit" if repeat else "miss",
    }


def plant_gpu_store(path: Path, ids_per_system: bool = True) -> list[dict]:
    """Both GPU systems × 1/2/4 GPUs × sAC 0, 1/2, 1 × 2 repeats, one oom and one error row on snellius.

    With ids_per_system=False both systems keep the planned trial ids, as one sweep file run at two sites does.
    """
    rows = []
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for system in GPU_SYSTEMS:
        for t in _trials():
            workers, ac = t.axis_values["resources.workers"], t.axis_values["train.ac_ratio"]
            status, message, metrics = "ok", "", gpu_metrics(system, workers, ac, t.repeat)
            if system == "snellius" and workers == 4 and ac == "0":
                status, message, metrics = "oom", "torch.OutOfMemoryError: CUDA out of memory", {"system": system}
            payload = t.payload
            if ids_per_system:
                payload = payload.replace(trial_id=f"{t.trial_id}-{system}")
            rows.append(build_row(payload, SWEEP, status, message, RankResult.from_columns(metrics), executor="pool",
                                  started_at=start,
                                  ended_at=start + timedelta(minutes=len(rows) + 1), wall_s=30.0))
    error = build_row(_trials()[0].payload.replace(trial_id="broken-r0"), SWEEP, "error", "RuntimeError: boom",
                      RankResult.from_columns({"system": "snellius"}), executor="pool", ended_at=start)
    rows.append(error)
    for row in rows:
        store.write_row(path, row)
    return rows


def plant_cpu_store(path: Path) -> list[dict]:
    """CPU rows as a laptop writes them: gpu_name null, host RSS as peak memory, no sAC axis beyond one value."""
    spec = parse_sweep({"name": "cpu", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": [1, 2]}})
    rows = []
    for t in plan(spec):
        mb = t.axis_values["train.micro_batch"]
        metrics = {"device_type": "cpu", "system": "laptop", "hostname": "laptop", "tok_per_s_per_device": 500.0 * mb,
                   "peak_rss_gib": 1.0 + 0.5 * mb, "step_time_p50_s": 0.1, "phase_data_mean_s": 0.001,
                   "phase_forward_mean_s": 0.03, "phase_backward_mean_s": 0.06, "phase_optimizer_mean_s": 0.009}
        rows.append(build_row(t.payload, "cpu", "ok", "", RankResult.from_columns(metrics), executor="pool"))
        store.write_row(path, rows[-1])
    return rows
