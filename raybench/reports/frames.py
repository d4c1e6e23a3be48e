"""Pandas views of stored rows shared by the report, its plots, `compare` and `export`.

Rows come from `store.read_results`. These helpers add the labels every view groups by (system, device, model,
configuration) and average repeats, so that no view re-derives them its own way.
"""

from __future__ import annotations

import functools
import json
import re
from fractions import Fraction

import pandas as pd

PHASES = ("data", "forward", "backward", "optimizer")
# nvidia-smi topo -m path kinds between GPUs that cross PCIe (switches, host bridge, NUMA node, SMP link).
_PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")


def system_label(df: pd.DataFrame) -> pd.Series:
    """The recorded system label; rows written before the column existed fall back to their hostname."""
    return df["system"].fillna(df["hostname"]).fillna("unknown").astype(str)


def device_label(df: pd.DataFrame) -> pd.Series:
    """The GPU model without the vendor prefix ("H100 80GB HBM3"), or "cpu" for CPU trials."""
    return df["gpu_name"].fillna("cpu").astype(str).str.removeprefix("NVIDIA ")


def peak_memory_gib(df: pd.DataFrame) -> pd.Series:
    """Peak memory per device: the CUDA allocator's reserved peak on GPUs, host RSS on CPU trials."""
    on_gpu = df["device_type"] == "cuda"
    return df["peak_reserved_gib"].where(on_gpu, df["peak_rss_gib"]).astype(float)


def model_label(df: pd.DataFrame) -> pd.Series:
    """The model preset, or the last part of a local model directory."""
    from_path = df["model_path"].map(lambda p: str(p).rstrip("/").rsplit("/", 1)[-1] if isinstance(p, str) else None)
    return df["model_preset"].fillna(from_path).fillna("?").astype(str)


def _flat(node: dict, prefix: str = "") -> dict[str, str]:
    """A trial config as dotted field -> value text."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


@functools.lru_cache(maxsize=1 << 16)
def _config_fields(config_json: str) -> dict[str, str]:
    """_flat of a row's config_json, parsed once per text: a report labels the same rows in every figure."""
    return _flat(json.loads(config_json))


@functools.lru_cache(maxsize=1 << 16)
def _axis_values(axis_values_json: str) -> dict:
    return json.loads(axis_values_json)


def config_label(df: pd.DataFrame, leave_out: tuple[str, ...] = ()) -> pd.Series:
    """A short name for a row's configuration: its axis values, then any other trial field whose value differs
    among `df`'s rows (two sweeps' base configs), e.g. `micro_batch=4 ac_ratio=1/2`; rows of one configuration
    share a label, and rows of two never do (a chart that groups by it groups by every field that varies)."""
    axes = [_axis_values(text) if isinstance(text, str) else {} for text in df["axis_values_json"]]
    fields = [_config_fields(text) if isinstance(text, str) else {} for text in df["config_json"]]
    named = {k for values in axes for k in values}
    keys = sorted({k for f in fields for k in f} - named - set(leave_out))
    varying = [k for k in keys if len({f.get(k) for f in fields}) > 1]

    def label(values: dict, flat: dict) -> str:
        parts = [f"{k.split('.')[-1]}={v}" for k, v in values.items() if k not in leave_out]
        parts += [f"{k.split('.')[-1]}={flat.get(k, '-')}" for k in varying]
        return " ".join(parts) or "base"

    return pd.Series([label(v, f) for v, f in zip(axes, fields)], index=df.index, dtype=str)


def _label_sort_key(label: str) -> tuple:
    """Natural order of configuration labels: numbers and fractions by value (ac_ratio=1/2 before ac_ratio=1)."""
    key = []
    for part in label.split():
        name, _, value = part.partition("=")
        try:
            key.append((name, 0, float(Fraction(value)), ""))
        except (ValueError, ZeroDivisionError):
            key.append((name, 1, 0.0, value))
    return tuple(key)


def natural_order(labels) -> list[str]:
    """Distinct configuration labels (or 'system label' strings) in natural order."""
    return sorted(set(labels), key=_label_sort_key)


def _without_workers(config_json) -> str:
    config = json.loads(config_json) if isinstance(config_json, str) else {}
    config.get("resources", {}).pop("workers", None)
    return json.dumps(config, sort_keys=True)


def scaling_key(df: pd.DataFrame) -> pd.Series:
    """Rows equal in everything but the worker count share a key: the points of one scaling curve."""
    return df["config_json"].map(_without_workers)


def interconnect(topology) -> str | None:
    """NVLink or PCIe from an `nvidia-smi topo -m` matrix (NV# cells are NVLink bonds); None when unknown."""
    if not isinstance(topology, str):
        return None
    cells = topology.split()
    if any(re.fullmatch(r"NV\d+", cell) for cell in cells):
        return "NVLink"
    if any(cell in _PCIE_PATHS for cell in cells):
        return "PCIe"
    return None


def ratio_value(text) -> float | None:
    """'1/2' → 0.5 (sAC ratios are stored as canonical fraction strings)."""
    try:
        return float(Fraction(str(text)))
    except (ValueError, ZeroDivisionError):
        return None


def labelled(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of the rows with the label columns every view groups by."""
    out = df.copy()
    out["system_label"] = system_label(df)
    out["device_label"] = device_label(df)
    out["model_label"] = model_label(df)
    out["config_label"] = config_label(df)
    out["peak_gib"] = peak_memory_gib(df)
    out["ac_ratio_value"] = df["train_ac_ratio"].map(ratio_value).astype(float)
    return out


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def failure_counts(df: pd.DataFrame) -> dict[str, int]:
    """How many rows ended in each status other than ok (`{"oom": 2, "error": 1}`)."""
    failed = df[df["status"] != "ok"]
    return {str(k): int(v) for k, v in failed["status"].value_counts().sort_index().items()}


def repeat_means(df: pd.DataFrame, keys: list[str], columns: list[str]) -> pd.DataFrame:
    """Mean, standard deviation (0 for a single repeat) and row count of `columns` per group of `keys`."""
    if len(df) == 0:
        return pd.DataFrame(columns=[*keys, *columns, *(f"{c}_std" for c in columns), "n"])
    numeric = df[keys + columns].copy()
    numeric[columns] = numeric[columns].astype(float)
    grouped = numeric.groupby(keys, sort=True, dropna=False)
    means = grouped[columns].mean()
    stds = grouped[columns].std(ddof=0).add_suffix("_std")
    return pd.concat([means, stds, grouped.size().rename("n")], axis=1).reset_index()
