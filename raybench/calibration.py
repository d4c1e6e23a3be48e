"""Calibrate the memory estimate with measured peaks: per model x strategy x device type, the median of
measured / estimated over the store's ok rows (every sweep in the store, latest attempt per trial).

A row's `est_peak_error` is measured / raw estimate - 1, so the ratio is 1 + est_peak_error. Rows stored before
the estimate existed have no error and do not count.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from raybench import store
from raybench.config import TrialConfig

Key = tuple[str, str, str]  # (model preset or path, strategy, device type)


def key_of(config: TrialConfig) -> Key:
    model = config.model.preset or config.model.path or ""
    return model, config.train.strategy, "cuda" if config.resources.gpus_per_worker > 0 else "cpu"


def factors(store_path: str | Path | None) -> dict[Key, tuple[float, int]]:
    """{key: (median measured/estimated ratio, rows)} from the store's ok rows that carry an estimate error."""
    if store_path is None or not Path(store_path).is_dir():
        return {}
    table = store.read_table(store_path)
    columns = ("status", "model_preset", "model_path", "train_strategy", "device_type", "est_peak_error")
    rows = zip(*(table.column(c).to_pylist() for c in columns))
    ratios: dict[Key, list[float]] = {}
    for status, preset, path, strategy, device, error in rows:
        if status == "ok" and error is not None and device:
            ratios.setdefault((preset or path or "", strategy, device), []).append(1 + error)
    return {k: (statistics.median(v), len(v)) for k, v in ratios.items()}
