"""Compare systems: the same configurations side by side, and the fingerprint differences that explain a gap.

This is the analysis the torchtune HPC benchmark did by hand (a steady ~15% gap between two similar clusters,
traced to GPU memory clocks): match configurations across systems, average repeats, put the metrics and their
ratio side by side, then list every recorded hardware/software property whose value differs between systems.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from raybench.reports import frames
from raybench.reports.report import render
from raybench.spec.errors import ConfigError, Problem

# Metric column → (table header, format); ratios are other system / first system.
METRICS = {
    "tok_per_s_per_device": ("tok/s/device", ",.0f"),
    "step_time_p50_s": ("step p50 s", ".3f"),
    "peak_gib": ("peak GiB", ".1f"),
    "mfu": ("MFU", ".3f"),
}
# Sampled over the timed steps (GPU rows only): summarised as ratios, not tabulated. A GPU at its power limit
# runs its SM clock below the maximum that the fingerprint records (an H200 at 700 W: docs/results/gpu-2026-11-26.md).
SAMPLED = {
    "gpu_sm_clock_mhz": ("SM clock MHz (sampled)", ".0f"),
    "gpu_power_w": ("power W (sampled)", ".0f"),
}
# Fingerprint column → what a difference in it can do to a trial. Order = order of the report.
EXPLANATIONS = {
    "device": "a different GPU model (or CPU)",
    "gpu_memory_gib": "a different memory size (40 and 80 GB parts of one GPU also differ in memory clock)",
    "gpu_mem_clock_max_mhz": "memory clock: memory-bound kernels run proportionally slower",
    "gpu_sm_clock_max_mhz": "SM clock: compute-bound kernels run proportionally slower",
    "gpu_power_limit_w": "power limit: clocks throttle when the GPU reaches it",
    "interconnect": "GPU-to-GPU links: NVLink carries collectives several times faster than PCIe",
    "allreduce_busbw_gbps": "measured all-reduce bandwidth: gradient and shard traffic time",
    "gpu_driver_version": "driver",
    "cuda_version": "CUDA runtime",
    "nccl_version": "NCCL (collective algorithms and tuning)",
    "torch_version": "PyTorch",
    "transformers_version": "transformers",
    "peft_version": "PEFT",
    "deepspeed_version": "DeepSpeed",
    "ray_version": "Ray",
    "python_version": "Python",
    "raybench_version": "raybench",
    "git_sha": "raybench source revision",
    "cpu_model": "host CPU (data loading, optimizer on CPU offload)",
    "cpu_count": "host CPU count",
    "ram_gib": "host memory",
    "data_fs_type": "filesystem of the data path",
    "platform": "operating system kernel",
}
_DERIVED = ("device", "interconnect")
# Measured (not configured) values differ run to run: only a relative gap beyond this counts.
TOLERANCE = {"allreduce_busbw_gbps": 0.10, "ram_gib": 0.05, "gpu_memory_gib": 0.02}
# Environment variables that identify a job rather than configure it.
_ENV_IGNORED = ("SLURM_", "CUDA_VISIBLE_DEVICES")


@dataclass
class Difference:
    column: str
    values: dict[str, str]  # system → value(s) as text
    why: str


@dataclass
class Comparison:
    systems: list[str]
    match: str
    table: pd.DataFrame  # one row per matched configuration: label, world_size, metric per system, ratios
    differences: list[Difference]
    same: list[str]  # fingerprint columns recorded on every system with one shared value
    unmatched: dict[str, int] = field(default_factory=dict)  # system → configurations found only there


def _listed(name: str, hostnames) -> bool:
    return isinstance(hostnames, (list, tuple, np.ndarray)) and name in list(hostnames)


def resolve_systems(df: pd.DataFrame, names: list[str] | None, source: str) -> list[str]:
    """System labels for the names given (labels, hostnames or cluster names); by default every system with ok rows.

    Only ok rows count: a system whose trials all failed has nothing to compare.
    """
    df = frames.ok_rows(df)
    labels = frames.system_label(df)
    known = sorted(labels.unique())
    if not names:
        names = known
    resolved, problems = [], []
    for name in names:
        ran_there = (labels == name) | (df["hostname"] == name) | df["hostnames"].map(lambda hs: _listed(name, hs))
        hits = sorted(set(labels[ran_there]))
        if not hits:
            problems.append(Problem("--systems", name, f"no ok rows from this system; systems with ok rows: "
                                                       f"{', '.join(known) or 'none'}"))
        resolved += [h for h in hits if h not in resolved]
    if not problems and len(resolved) < 2:
        problems.append(Problem("--systems", ",".join(names), f"compare needs two or more systems; systems with "
                                                              f"ok rows: {', '.join(known) or 'none'}"))
    if problems:
        raise ConfigError(source, problems)
    return resolved


def _match_key(df: pd.DataFrame, match: str) -> pd.Series:
    if match == "config":
        return df["config_id"].astype(str)
    # Same sweep name and axis values: for sites whose sweep files differ only in paths (model, data, cache).
    return df["sweep"].astype(str) + " " + df["axis_values_json"].astype(str)


def _env(env_json) -> dict[str, str]:
    env = json.loads(env_json) if isinstance(env_json, str) else {}
    return {k: v for k, v in env.items() if not k.startswith(_ENV_IGNORED)}


def _fingerprints(rows: pd.DataFrame) -> pd.DataFrame:
    """Fingerprint columns of rows, plus the device, NVLink/PCIe from the topology, and env vars as columns."""
    out = rows.reindex(columns=[c for c in EXPLANATIONS if c not in _DERIVED]).copy()
    out["device"] = frames.device_label(rows)  # gpu_name, "cpu" where there is none
    out["interconnect"] = rows["gpu_topology"].map(frames.interconnect)
    envs = rows["env_json"].map(_env)
    for name in sorted({k for env in envs for k in env}):
        out[f"env {name}"] = envs.map(lambda env, name=name: env.get(name, "(unset)"))
    return out


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _differences(rows: pd.DataFrame, systems: list[str]) -> tuple[list[Difference], list[str]]:
    prints = _fingerprints(rows)
    columns = [c for c in [*EXPLANATIONS, *sorted(c for c in prints if c.startswith("env "))] if c in prints]
    differences, same = [], []
    for column in columns:
        per_system = {s: prints.loc[rows["system_label"] == s, column].dropna() for s in systems}
        if any(len(v) == 0 for v in per_system.values()):
            continue  # unknown on some system: nothing to compare
        if column in TOLERANCE:
            medians = {s: float(v.astype(float).median()) for s, v in per_system.items()}
            low, high = min(medians.values()), max(medians.values())
            differs = low <= 0 or high / low - 1 > TOLERANCE[column]
            shown = {s: f"{m:.3g}" for s, m in medians.items()}
        else:
            values = {s: sorted(set(map(_text, v))) for s, v in per_system.items()}
            differs = len({tuple(v) for v in values.values()}) > 1
            shown = {s: " | ".join(v) for s, v in values.items()}
        if differs:
            why = EXPLANATIONS.get(column, "environment variable of the ranks")
            differences.append(Difference(column, shown, why))
        else:
            same.append(column)
    return differences, same


def _labels(matched: pd.DataFrame) -> dict[str, str]:
    """One name per matched configuration: its axis values, after its sweep's name when several sweeps show.

    A configuration id can occur in several sweeps (same resolved config); its first name is used.
    """
    several_sweeps = matched["sweep"].nunique() > 1
    names = (matched["sweep"] + ": " + matched["config_label"]) if several_sweeps else matched["config_label"]
    return names.groupby(matched["match_key"]).first().to_dict()


def compare(df: pd.DataFrame, systems: list[str] | None = None, match: str = "config",
            source: str = "store") -> Comparison:
    """Matching ok configurations of the given systems side by side (repeats averaged).

    `df` holds the store's measurements (`read_results`): repeats of a configuration are averaged.
    """
    systems = resolve_systems(df, systems, source)
    rows = frames.labelled(frames.ok_rows(df))
    rows = rows[rows["system_label"].isin(systems)].assign(match_key=_match_key(rows, match))
    present = rows.groupby("match_key")["system_label"].nunique()
    matched_keys = set(present[present == len(systems)].index)
    unmatched = {s: int(rows.loc[(rows["system_label"] == s) & ~rows["match_key"].isin(matched_keys), "match_key"]
                        .nunique()) for s in systems}
    matched = rows[rows["match_key"].isin(matched_keys)]
    columns = [*METRICS, *SAMPLED]
    means = frames.repeat_means(matched, ["match_key", "world_size", "system_label"], columns)
    table = pd.DataFrame()
    if len(means):
        labels = _labels(matched)
        order = {label: i for i, label in enumerate(frames.natural_order(labels.values()))}
        means = means.assign(label=means["match_key"].map(labels))
        means = means.assign(order=means["label"].map(order))
        table = (means.pivot(index=["order", "match_key", "label", "world_size"], columns="system_label",
                             values=columns).reset_index().sort_values(["order", "world_size"]))
    differences, same = _differences(matched, systems)
    return Comparison(systems, match, table, differences, same, unmatched)


def _cell(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def ratios(comparison: Comparison, metric: str) -> dict[str, list[float]]:
    """Per other system: its metric over the first system's, one ratio per matched configuration."""
    if comparison.table.empty:
        return {}
    base = comparison.table[(metric, comparison.systems[0])]
    return {s: [r for r in (comparison.table[(metric, s)] / base).tolist() if not math.isnan(r)]
            for s in comparison.systems[1:]}


def geometric_mean(values: list[float]) -> float | None:
    positive = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, positive)) / len(positive)) if positive else None


def summary_lines(comparison: Comparison) -> list[str]:
    first = comparison.systems[0]
    lines = []
    for metric, (header, _) in {**METRICS, **SAMPLED}.items():
        for system, values in ratios(comparison, metric).items():
            mean = geometric_mean(values)
            if mean is not None:
                lines.append(f"{system}/{first} {header}: geometric mean {mean:.3f} (min {min(values):.3f}, "
                             f"max {max(values):.3f}) over {len(values)} configuration(s)")
    return lines


def table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    first, others = comparison.systems[0], comparison.systems[1:]
    headers = ["configuration", "devices"]
    for metric, (header, _) in METRICS.items():
        headers += [f"{header} {s}" for s in comparison.systems] + [f"{header} {s}/{first}" for s in others]
    rows = []
    for _, r in comparison.table.iterrows():
        cells = [str(r[("label", "")]), _cell(r[("world_size", "")], ".0f")]
        for metric, (_, spec) in METRICS.items():
            cells += [_cell(r[(metric, s)], spec) for s in comparison.systems]
            cells += [_cell(r[(metric, s)] / r[(metric, first)], ".3f") for s in others]
        rows.append(cells)
    return headers, rows


def difference_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    headers = ["fingerprint", *comparison.systems, "why it matters"]
    return headers, [[d.column, *(d.values[s] for s in comparison.systems), d.why] for d in comparison.differences]


def comparison_text(comparison: Comparison) -> str:
    systems = " vs ".join(comparison.systems)
    lines = [f"{systems}: {len(comparison.table)} matched configuration(s) (matched by {comparison.match})"]
    lines += [f"  {s}: {n} configuration(s) not ok on every other system, left out"
              for s, n in comparison.unmatched.items() if n]
    if comparison.table.empty:
        return "\n".join(lines + ["no configuration ran ok on every system; nothing to compare"])
    lines += ["", render(*table_rows(comparison)), "", *summary_lines(comparison), ""]
    if comparison.differences:
        lines += ["fingerprint differences (what may explain the gap):", render(*difference_rows(comparison))]
    else:
        lines.append("no recorded fingerprint differs between these systems (values unknown on one are skipped)")
    if comparison.same:
        lines += ["", f"same on every system: {', '.join(comparison.same)}"]
    return "\n".join(lines)


def comparison_json(comparison: Comparison) -> dict:
    headers, rows = table_rows(comparison) if not comparison.table.empty else ([], [])
    return {
        "systems": comparison.systems, "match": comparison.match, "unmatched": comparison.unmatched,
        "configurations": [dict(zip(headers, r)) for r in rows],
        "ratios": {m: ratios(comparison, m) for m in METRICS},
        "differences": [{"column": d.column, "values": d.values, "why": d.why} for d in comparison.differences],
        "same": comparison.same,
    }
