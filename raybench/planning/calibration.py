"""Calibrate the memory estimate with measured peaks: per model x strategy x device type, the median of
measured / estimated over the store's ok rows (every sweep in the store, the latest attempt of each measurement).

A row's `est_peak_error` is measured / raw estimate - 1, so the ratio is 1 + est_peak_error. Rows stored before
the estimate existed have no error and do not count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from raybench.results import store
from raybench.results.rehearsals import rehearsals
from raybench.spec.hardware import find_gpu
from raybench.spec.sweep_spec import TrialConfig

Key = tuple[str, str, str]  # (model preset or path, strategy, device type)


def key_of(config: TrialConfig) -> Key:
    model = config.model.preset or config.model.path or ""
    return model, config.train.strategy, "cuda" if config.resources.gpus_per_worker > 0 else "cpu"


@dataclass(frozen=True)
class Evidence:
    """What a store tells the plan: measured / estimated peak ratios, and the stored rehearsals."""

    factors: dict[Key, tuple[float, int]] = field(default_factory=dict)
    rehearsals: dict[str, dict] = field(default_factory=dict)  # config_id -> rehearsal


def evidence(store_path: str | Path | None, attempts: pa.Table | None = None) -> Evidence:
    """The store's evidence; from `attempts` (store.read_table(store_path, latest=False)) when the caller has
    read the rows already, else read here."""
    if attempts is None:
        return Evidence(factors(store_path), rehearsals(store_path))
    return Evidence(factors_of(store.latest_per_trial(attempts)), rehearsals(store_path))


def factors(store_path: str | Path | None) -> dict[Key, tuple[float, int]]:
    """{key: (median measured/estimated ratio, rows)} from the store's ok rows that carry an estimate error."""
    if store_path is None or not Path(store_path).is_dir():
        return {}
    return factors_of(store.read_table(store_path))


def factors_of(table: pa.Table) -> dict[Key, tuple[float, int]]:
    """`factors` over rows already read: the latest attempt of each measurement, of every sweep."""
    columns = ("status", "model_preset", "model_path", "train_strategy", "device_type", "est_peak_error")
    rows = zip(*(table.column(c).to_pylist() for c in columns))
    ratios: dict[Key, list[float]] = {}
    for status, preset, path, strategy, device, error in rows:
        if status == "ok" and error is not None and device:
            ratios.setdefault((preset or path or "", strategy, device), []).append(1 + error)
    return {k: (statistics.median(v), len(v)) for k, v in ratios.items()}


def probe_busbw_gbps(store_path: str | Path | None, world_size: int, gpu: str | None) -> float | None:
    """The highest all-reduce bus bandwidth (GB/s) stored rows of this world size on this GPU measured; None
    without such rows (the probe runs only when a sweep runs multi-rank trials for a store)."""
    if store_path is None or not Path(store_path).is_dir() or world_size < 2:
        return None
    table = store.read_table(store_path)
    columns = ("world_size", "gpu_name", "allreduce_busbw_gbps")
    found = [bw for world, name, bw in zip(*(table.column(c).to_pylist() for c in columns))
             if world == world_size and bw and (gpu is None or _same_gpu(name, gpu))]
    return max(found) if found else None


def _same_gpu(name: str | None, gpu: str) -> bool:
    return name is not None and find_gpu(name) is not None and find_gpu(name) == find_gpu(gpu)
