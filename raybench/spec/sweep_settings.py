"""The sweep's settings that are part of no trial (nor of its id): the warm pool, the caches, the full-run cost
projection, the estimate and its pruning, and how the grid is searched."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raybench.spec.section import Section


class PoolSpec(Section):
    recycle_after_trials: int = Field(200, ge=1, le=1_000_000, description=(
        "Replace a pool group's actors after this many trials (bounds slow memory creep)."))
    weights_cache_gib: float = Field(4.0, ge=0, le=4096, description=(
        "Host memory each pool actor may keep for the weights of the models it last loaded, so the next trial "
        "on the same model skips loading them (0: off)."))


class CacheSpec(Section):
    """Where trials keep what later trials reuse (not part of trial ids: caches change no measurement)."""

    weights_local_copy: Literal["auto", "always", "never"] = Field("auto", description=(
        "Copy a model.path directory once per node to node-local disk (RAYBENCH_LOCAL_DIR, SLURM_TMPDIR, TMPDIR "
        "or /tmp) and load it from there: 'auto' when it is on a network filesystem (NFS, Lustre, GPFS, ...)."))
    compile_dir: str | None = Field(None, description=(
        "Inductor/Triton cache of compiled trials (train.compile) shared by every trial and node of the store; "
        "null: <store>/_cache/compile. train.compile_cache_dir, when set, wins."))


class ProjectionSpec(Section):
    """The full run the user plans, to project each trial's hours and GPU-hours (not part of trial ids)."""

    dataset_tokens: float | None = Field(None, gt=0, description=(
        "Real (non-padding) tokens in the training set (one epoch)."))
    epochs: float = Field(1.0, gt=0, description="Passes over dataset_tokens.")
    total_steps: int | None = Field(None, ge=1, description="Optimizer steps of the full run (instead of tokens).")


class EstimateSpec(Section):
    """Per-trial memory and step-time estimate, and pruning of trials that cannot fit (not part of trial ids)."""

    gpu: str | None = Field(None, description=(
        "GPU the sweep's GPU trials run on, e.g. 'H100 SXM', 'H100 PCIe', 'H200', 'A100 80GB': its dense peak "
        "gives the step-time guess and its memory the default device_memory_gib (docs/estimate.md)."))
    device_memory_gib: float | None = Field(None, gt=0, le=65536, description=(
        "Memory one rank may use: a GPU's memory, or host memory per worker on CPU trials; null: from gpu."))
    margin_fraction: float | None = Field(None, ge=0, lt=1, description=(
        "Share of device memory kept free of the estimate; null: 0.1 unless margin_gib is set."))
    margin_gib: float | None = Field(None, ge=0, le=65536, description="Memory kept free, in GiB (instead of "
                                     "margin_fraction).")
    busbw_gbps: float | None = Field(None, gt=0, le=100_000, description=(
        "Bus bandwidth (GB/s, as nccl-tests reports busbw) the trials' collectives reach on the cluster they will "
        "run on, for `raybench rehearse` step times; it overrides the store's all-reduce probe and the nominal "
        "links of estimate.gpu (docs/rehearse.md). null: the probe, else the links."))
    gpus_per_node: int | None = Field(None, ge=1, le=100_000, description=(
        "GPUs one node's NVLink joins (8 in an HGX node, 4 in many H100 nodes, 72 in a GB200 NVL72 rack): "
        "collectives beyond a node cross the network, for `raybench rehearse` step times. null: the NVLink "
        "domain of estimate.gpu (spec/hardware.py)."))
    nics_per_node: int | None = Field(None, ge=1, le=100_000, description=(
        "Network adapters of such a node, which NCCL spreads its rings over; null: one per GPU."))
    prune: bool = Field(True, description=(
        "Mark trials whose estimated peak (calibrated by stored measurements) plus margin exceeds the device "
        "memory as skipped, with the estimate in their row, instead of running them."))


Mode = Literal["max", "min"]
# Metrics whose name says "smaller is better": times, memory, hours, losses. Everything else is maximized.
_MIN_SUFFIXES, _MIN_PREFIXES = ("_s", "_gib", "_hours"), ("loss_",)


def default_mode(metric: str) -> Mode:
    """max or min for a stored metric when the user does not say: times, memory and losses are minimized."""
    return "min" if metric.endswith(_MIN_SUFFIXES) or metric.startswith(_MIN_PREFIXES) else "max"


class SearchSpec(Section):
    """How the grid of `axes` is explored: every point, or points chosen one by one by a searcher."""

    algo: Literal["grid", "random", "optuna"] = Field("grid", description=(
        "grid runs every point; random draws points uniformly, never one twice; optuna chooses each next point "
        "with Optuna's TPE sampler, learning from every result, failed ones too."))
    metric: str | list[str] = Field("tok_per_s_per_device", description=(
        "Stored metric column to optimize, or a list of them for a multi-objective search (the result is a "
        "Pareto front), e.g. [tok_per_s_per_device, peak_reserved_gib]."))
    mode: Mode | list[Mode] | None = Field(None, description=(
        "max or min, one per metric; null: inferred from each name (*_s, *_gib, *_hours, loss_* are minimized)."))
    num_samples: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Distinct grid points to evaluate (run, or answered from stored ok rows); null: the whole grid at most."))
    seed: int = Field(0, ge=0, description="Searcher seed: the same seed and store give the same points.")
    max_concurrent: int | None = Field(None, ge=1, le=100_000, description=(
        "Trials in flight at once (fewer lets the searcher learn from more results); null: as many as fit."))
    early_stop: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Stop after this many evaluated points in a row without a better value (multi-objective: without a new "
        "point on the Pareto front); null: off."))

    def objectives(self) -> list[tuple[str, Mode]]:
        """(metric, mode) pairs, modes filled in from the metric names where not given."""
        metrics = [self.metric] if isinstance(self.metric, str) else list(self.metric)
        modes = self.mode if isinstance(self.mode, list) else [self.mode] * len(metrics)
        return [(m, mode or default_mode(m)) for m, mode in zip(metrics, modes)]
