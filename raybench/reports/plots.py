"""Report figures from stored rows (matplotlib, Agg; imported only by the report, so `plan` stays fast).

Each figure mirrors one the seed studies drew by hand: tokens/s per GPU by system and GPU count (the torchtune
HPC comparison), stacked per-phase step time (ORNL's BERT profile), sAC ratio against throughput and peak memory
(IDRIS), scaling efficiency against GPU count, and the throughput–memory Pareto front. Only ok rows are plotted
(repeats averaged, with their standard deviation as error bars); failed rows are counted in each subtitle.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, never need a display

import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from raybench.reports import frames  # noqa: E402

MS_PER_S = 1000.0
# Beyond these, a figure keeps the fastest configurations (its subtitle says how many of how many).
MAX_CATEGORIES, MAX_BARS, MAX_LINES = 12, 40, 10
_CONFIG_KEYS = ["system_label", "device_label", "model_label", "config_id", "world_size", "config_label"]


def _per_device_label(ok: pd.DataFrame) -> str:
    on_gpu = len(ok) > 0 and bool((ok["device_type"] == "cuda").all())
    return "tokens/s per GPU" if on_gpu else "tokens/s per device (CPU: per worker process)"


def _subtitle(df: pd.DataFrame, plotted: int, note: str) -> str:
    failed = frames.failure_counts(df)
    text = f"{plotted} configuration(s) plotted{note} from {int((df['status'] == 'ok').sum())} ok row(s)"
    if failed:
        text += "; not plotted: " + ", ".join(f"{n} {status}" for status, n in failed.items())
    return text


def _figure(title: str, df: pd.DataFrame, plotted: int, width_in: float = 9.0, height_in: float = 5.0,
            panels: int = 1, note: str = "", stacked: bool = False) -> tuple[Figure, list]:
    """A figure with `panels` axes side by side (or one above the other when `stacked`) and a subtitle."""
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    grid = fig.subplots(panels, 1, squeeze=False) if stacked else fig.subplots(1, panels, squeeze=False)
    axes = grid.ravel().tolist()
    fig.suptitle(f"{title}\n{_subtitle(df, plotted, note)}", fontsize=10)
    return fig, axes


def _no_data(ax, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4")
    ax.set_axis_off()


def _colors(systems) -> dict[str, str]:
    """One colour per system, the same in every figure of a report."""
    palette = [f"C{i}" for i in range(10)]
    return {s: palette[i % len(palette)] for i, s in enumerate(sorted(set(systems)))}


def _config_means(df: pd.DataFrame, columns: list[str], extra_keys: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per configuration and system: means of `columns` over repeats, rows missing them left out."""
    ok = frames.ok_rows(df).dropna(subset=columns)
    return frames.repeat_means(ok, _CONFIG_KEYS + list(extra_keys), columns)


def _ordered(means: pd.DataFrame, label_column: str, first: tuple[str, ...] = ()) -> pd.DataFrame:
    """Rows sorted by `first` columns, then by their configuration label in natural order."""
    rank = {label: i for i, label in enumerate(frames.natural_order(means[label_column]))}
    return means.assign(_rank=means[label_column].map(rank)).sort_values([*first, "_rank"]).drop(columns="_rank")


def _fastest(means: pd.DataFrame, groups: list[str], limit: int) -> tuple[pd.DataFrame, str]:
    """The `limit` groups (bars, lines) with the highest throughput, and a note when others were left out.

    A large grid would otherwise draw thousands of unreadable bars or lines (and take minutes to render).
    """
    best = means.groupby(groups, dropna=False)["tok_per_s_per_device"].max()
    if len(best) <= limit:
        return means, ""
    keep = means.set_index(groups).index.isin(best.nlargest(limit).index)
    return means[keep], f" (the {limit} fastest of {len(best):,})"


def throughput_by_system(df: pd.DataFrame) -> Figure:
    """Seed 000's figure: bars of tokens/s per GPU, one colour per system, one panel per GPU count."""
    labelled = frames.labelled(df).assign(setup=frames.config_label(df, leave_out=("resources.workers",)))
    means, note = _fastest(_config_means(labelled, ["tok_per_s_per_device"], ("setup",)),
                           ["device_label", "setup"], MAX_CATEGORIES)
    title = "Throughput by system and GPU count"
    if len(means) == 0:
        fig, axes = _figure(title, df, 0)
        _no_data(axes[0], "no ok rows with tok_per_s_per_device")
        return fig
    # x positions: one per (device, setup) pair; a part shared by every bar goes into the title instead.
    means = _ordered(means, "setup", ("device_label",))
    categories = list(dict.fromkeys(zip(means["device_label"], means["setup"])))
    devices, setups = means["device_label"].unique(), means["setup"].unique()
    names = ["\n".join(part for part, varies in ((d, len(devices) > 1), (s.replace(" ", "\n"), len(setups) > 1))
                       if varies) or s for d, s in categories]
    shared = " · ".join([*([devices[0]] if len(devices) == 1 else []), *([setups[0]] if len(setups) == 1 else [])])
    counts = sorted(means["world_size"].dropna().unique())
    # Few bars: GPU-count panels side by side as in seed 000; many: panels one above the other, full width.
    side_by_side = len(categories) <= 4
    label_lines = max(name.count("\n") + 1 for name in names)
    size = ((4.0 + 3.5 * len(counts), 5.0) if side_by_side else
            (max(8.0, 1.1 * len(categories)), len(counts) * (2.8 + 0.15 * label_lines) + 1.0))
    fig, axes = _figure(title, df, len(means), *size, panels=len(counts), note=note, stacked=not side_by_side)
    unit = "GPU(s)" if means["device_label"].ne("cpu").all() else "worker(s)"
    colors = _colors(means["system_label"])
    width = 0.8 / len(colors)
    for ax, count in zip(axes, counts):
        panel = means[means["world_size"] == count]
        for i, (system, color) in enumerate(colors.items()):
            bars = panel[panel["system_label"] == system]
            xs = [categories.index(c) - 0.4 + width * (i + 0.5) for c in zip(bars["device_label"], bars["setup"])]
            ax.bar(xs, bars["tok_per_s_per_device"], width, yerr=bars["tok_per_s_per_device_std"], color=color,
                   label=system, capsize=2)
            if len(categories) * len(colors) <= 24:  # values on the bars while they stay legible
                for x, value in zip(xs, bars["tok_per_s_per_device"]):
                    ax.annotate(f"{value:,.0f}", (x, value), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{int(count)} {unit}" + (f" · {shared}" if shared else ""), fontsize=9)
        ax.set_xticks(range(len(categories)), names, fontsize=7)
        ax.set_ylabel(_per_device_label(frames.ok_rows(df)))
    axes[0].legend(title="system", fontsize=8)
    return fig


def phase_breakdown(df: pd.DataFrame) -> Figure:
    """Seed 004's figure: one stacked bar per configuration of the mean data/forward/backward/optimizer times.

    Bars lie horizontally so that long configuration names stay readable for any number of them.
    """
    columns = [f"phase_{p}_mean_s" for p in frames.PHASES]
    means, note = _fastest(_config_means(frames.labelled(df), [*columns, "tok_per_s_per_device"]),
                           ["system_label", "config_id"], MAX_BARS)
    # Listed top to bottom: barh draws its first bar at the bottom.
    means = _ordered(means, "config_label", ("system_label",)).iloc[::-1]
    fig, axes = _figure("Step time by phase (mean over timed steps)", df, len(means), 10.0,
                        2.0 + 0.35 * max(len(means), 4), note=note)
    ax = axes[0]
    if len(means) == 0:
        _no_data(ax, "no ok rows with phase times")
        return fig
    ys = range(len(means))
    left = pd.Series(0.0, index=means.index)
    for phase, column in zip(frames.PHASES, columns):
        widths = means[column] * MS_PER_S
        ax.barh(ys, widths, 0.7, left=left, label=phase)
        left = left + widths
    several_systems = means["system_label"].nunique() > 1
    labels = [f"{r.system_label} · {r.config_label}" if several_systems else r.config_label
              for r in means.itertuples()]
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_xlabel("time per step (ms)")
    ax.legend(title="phase", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def sac_tradeoff(df: pd.DataFrame) -> Figure:
    """Seed 001's study: throughput and peak memory against the sAC ratio, one line per GPU type and model."""
    labelled = frames.labelled(df)
    labelled["others"] = frames.config_label(df, leave_out=("train.ac_ratio",))
    means, note = _fastest(_config_means(labelled, ["ac_ratio_value", "tok_per_s_per_device", "peak_gib"],
                                         ("others",)), ["system_label", "device_label", "model_label", "others"],
                           MAX_LINES)
    fig, (speed_ax, memory_ax) = _figure("sAC ratio: throughput and peak memory", df, len(means), 12.0, 5.5, 2,
                                         note)
    if len(means) == 0:
        _no_data(speed_ax, "no ok rows with sAC ratio, throughput and peak memory")
        _no_data(memory_ax, "")
        return fig
    several_systems = means["system_label"].nunique() > 1
    several_setups = means["others"].nunique() > 1
    for (system, device, model, others), line in means.groupby(
            ["system_label", "device_label", "model_label", "others"], sort=True):
        line = line.sort_values("ac_ratio_value")
        label = " ".join([*([system] if several_systems else []), device, model, *([others] if several_setups else [])])
        for ax, column in ((speed_ax, "tok_per_s_per_device"), (memory_ax, "peak_gib")):
            ax.errorbar(line["ac_ratio_value"], line[column], yerr=line[f"{column}_std"], marker="o", capsize=2,
                        label=label)
    for ax in (speed_ax, memory_ax):
        ax.set_xlabel("sAC ratio (fraction of blocks checkpointed)")
        ax.set_xlim(-0.05, 1.05)
    speed_ax.set_ylabel(_per_device_label(frames.ok_rows(df)))
    memory_ax.set_ylabel("peak memory per device (GiB; CPU: host RSS)")
    speed_ax.legend(fontsize=7)
    return fig


def scaling_efficiency(df: pd.DataFrame) -> Figure:
    """Tokens/s per GPU at N GPUs over tokens/s per GPU at the fewest GPUs measured, per configuration."""
    labelled = frames.labelled(df).assign(curve=frames.scaling_key(df),
                                          setup=frames.config_label(df, leave_out=("resources.workers",)))
    groups = ["system_label", "device_label", "curve", "setup"]
    means = _config_means(labelled, ["tok_per_s_per_device"], ("curve", "setup"))
    measured = len(means)
    # A configuration measured at one device count has no scaling curve: a lone point at 1.0 says nothing.
    means = means[means.groupby(groups)["world_size"].transform("nunique") > 1] if measured else means
    means, note = _fastest(means, groups, MAX_LINES)
    fig, axes = _figure("Scaling efficiency (tokens/s per device relative to the fewest devices)", df, len(means),
                        note=note)
    ax = axes[0]
    if len(means) == 0:
        _no_data(ax, "no configuration was measured at two or more device counts (sweep resources.workers)"
                 if measured else "no ok rows with tok_per_s_per_device")
        return fig
    several_systems = means["system_label"].nunique() > 1
    for (system, device, _, setup), curve in means.groupby(["system_label", "device_label", "curve", "setup"]):
        curve = curve.sort_values("world_size")
        base = curve["tok_per_s_per_device"].iloc[0]
        efficiency = curve["tok_per_s_per_device"] / base
        label = " ".join([*([system] if several_systems else []), device, setup])
        ax.plot(curve["world_size"], efficiency, marker="o", label=label)
    ax.axhline(1.0, color="0.6", linestyle="--", linewidth=1, label="ideal (linear)")
    ax.set_xlabel("GPUs (CPU: worker processes)")
    ax.set_ylabel("scaling efficiency")
    ax.set_xticks(sorted(means["world_size"].dropna().unique().astype(int)))
    ax.legend(fontsize=7)
    return fig


def pareto_front(points: pd.DataFrame) -> pd.DataFrame:
    """The points no other point beats on both counts (less or equal memory and more or equal throughput).

    One sorted pass (stats.pareto_mask compares every pair: too slow for the thousands of points of a big grid).
    """
    ordered = points.sort_values(["peak_gib", "tok_per_s_per_device"], ascending=[True, False])
    best = float("-inf")
    keep = []
    for index, value in ordered["tok_per_s_per_device"].items():
        if value > best:
            keep.append(index)
            best = value
    return ordered.loc[keep]


def throughput_memory_pareto(df: pd.DataFrame) -> Figure:
    """Every configuration as a point (peak memory, tokens/s per device); each system's Pareto front joined."""
    means = _config_means(frames.labelled(df), ["tok_per_s_per_device", "peak_gib"])
    fig, axes = _figure("Throughput against peak memory (Pareto front per system)", df, len(means))
    ax = axes[0]
    if len(means) == 0:
        _no_data(ax, "no ok rows with throughput and peak memory")
        return fig
    for system, color in _colors(means["system_label"]).items():
        points = means[means["system_label"] == system]
        ax.scatter(points["peak_gib"], points["tok_per_s_per_device"], color=color, alpha=0.5, label=system)
        front = pareto_front(points)
        ax.step(front["peak_gib"], front["tok_per_s_per_device"], where="post", color=color, linewidth=1.5)
        for r in front.itertuples():
            ax.annotate(r.config_label, (r.peak_gib, r.tok_per_s_per_device), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("peak memory per device (GiB; CPU: host RSS)")
    ax.set_ylabel(_per_device_label(frames.ok_rows(df)))
    ax.legend(title="system", fontsize=8)
    return fig


# File stem → (caption, figure function); the report writes them in this order.
PLOTS: dict[str, tuple[str, Callable[[pd.DataFrame], Figure]]] = {
    "throughput": ("Tokens/s per device (GPU, or worker process on CPU) by system and device count",
                   throughput_by_system),
    "phases": ("Step time split into data, forward, backward and optimizer phases", phase_breakdown),
    "sac": ("sAC ratio against throughput and peak memory", sac_tradeoff),
    "scaling": ("Scaling efficiency against GPU count", scaling_efficiency),
    "pareto": ("Throughput–memory Pareto front", throughput_memory_pareto),
}


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_all(df: pd.DataFrame) -> dict[str, bytes]:
    """Every report figure as PNG bytes, keyed by file stem."""
    return {name: png_bytes(draw(df)) for name, (_, draw) in PLOTS.items()}
