"""The trial payload: everything a trial driver, an executor and every rank need to run one planned trial.

One frozen type crosses every boundary below the plan: Ray pickles it to actors, and `to_dict`/`from_dict` carry
it as plain JSON data through Ray Tune's trial config and torchrun's payload file. Runtime settings that change
no measurement (the environment a launcher gives the ranks, cache directories) are derived here, once.

It is the contract between the plan and what runs a trial, so it lives in the spec layer and holds plain data
only: the plan's assessment travels as `AssessmentData` (planning.assessment converts), the tokenized data as its
handle (spec.tokenized_data). A rank imports this module and never the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raybench.spec.stacks import kind
from raybench.spec.sweep_settings import CacheSpec, PoolSpec, ProjectionSpec
from raybench.spec.sweep_spec import TrialConfig
from raybench.spec.tokenized_data import TokenizedData
from raybench.spec.values import MALLOC_MMAP_THRESHOLD

# glibc's default initial M_MMAP_THRESHOLD; set explicitly, glibc no longer raises it (mallopt(3)).
MALLOC_MMAP_THRESHOLD_BYTES = 128 * 1024


@dataclass(frozen=True)
class AssessmentData:
    """The plan's memory and step-time assessment of one trial (planning.assessment.Assessment) as plain data:
    its JSON mapping whole, so `raybench plan --json` and every hop through Tune configs and payload files keep
    all of it, and typed reads of what a result row takes (planning.assessment.row_fields)."""

    values: dict[str, Any]  # Assessment.as_dict(): the analytic estimate's keys, the judgement's, the intervals

    @property
    def analytic_peak_gib(self) -> float:
        """The analytic estimate's peak, uncalibrated."""
        return self.values["peak_gib"]

    @property
    def measured_part_gib(self) -> float:
        """The part of the analytic peak that a trial's measured peak covers."""
        return self.values["measured_part_gib"]

    @property
    def peak_calibrated_gib(self) -> float:
        return self.values["peak_calibrated_gib"]

    @property
    def analytic_step_time_s(self) -> float | None:
        """The analytic step-time guess (the estimate's, not the rehearsal's)."""
        return self.values["step_time_s"]


@dataclass(frozen=True)
class TrialPayload:
    trial_id: str
    config_id: str
    repeat: int
    config: TrialConfig
    axis_values: dict[str, Any]
    ac_blocks: tuple[int, ...]  # 0-based indices of the activation-checkpointed decoder blocks
    num_layers: int
    projection: ProjectionSpec = field(default_factory=ProjectionSpec)  # the user's full run; not part of the id
    pool: PoolSpec = field(default_factory=PoolSpec)  # warm-pool settings; not part of the id
    caches: CacheSpec = field(default_factory=CacheSpec)  # weights and compile caches; not part of the id
    # The plan's memory/step-time assessment (None for an invalid combination); not part of the id.
    assessment: AssessmentData | None = None
    # Set by the trial driver: the store's per-cluster cache directory (all-reduce probe, data, compile caches).
    cache_dir: str | None = None
    # Set by the sweep's driver before launch: the hf data it tokenized (or found) in the store; not part of the id.
    tokenized: TokenizedData | None = None
    # Set by the warm pool: host memory a long-lived worker may keep for the weights of the next trial, and how
    # many trials the worker process ran before this one (0: a fresh process).
    weights_cache_gib: float = 0.0
    process_trial_index: int = 0

    def replace(self, **changes) -> TrialPayload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-safe data (Tune trial configs, torchrun's payload file, `raybench plan --json`); the
        assessment goes under "estimate", as an empty mapping when there is none."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "assessment"}
        for name in ("config", "projection", "pool", "caches"):
            data[name] = data[name].model_dump(mode="json")
        data["ac_blocks"] = list(self.ac_blocks)
        data["tokenized"] = dataclasses.asdict(self.tokenized) if self.tokenized else None
        data["estimate"] = dict(self.assessment.values) if self.assessment else {}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TrialPayload:
        fields = {k: v for k, v in data.items() if k != "estimate"}
        return cls(**{**fields, "config": TrialConfig.model_validate(data["config"]),
                      "projection": ProjectionSpec.model_validate(data["projection"]),
                      "pool": PoolSpec.model_validate(data["pool"]),
                      "caches": CacheSpec.model_validate(data["caches"]),
                      "ac_blocks": tuple(data["ac_blocks"]),
                      "tokenized": TokenizedData(**data["tokenized"]) if data.get("tokenized") else None,
                      "assessment": AssessmentData(dict(data["estimate"])) if data.get("estimate") else None})

    def compile_cache_dir(self) -> str | None:
        """Where a compiled trial caches its kernels: train.compile_cache_dir, else caches.compile_dir, else the
        store's cache directory, which every trial on every node of the cluster shares (compile once per
        cluster)."""
        train = self.config.train
        if train.compile_cache_dir:
            return train.compile_cache_dir
        if not train.compile:
            return None
        if self.caches.compile_dir:
            return self.caches.compile_dir
        return str(Path(self.cache_dir) / "compile") if self.cache_dir else None

    def threads_env(self) -> dict[str, str]:
        """Each rank's CPU threads: its reserved CPUs, as Ray gives a worker of `cpus_per_worker` CPUs. A launcher
        without Ray sets them so that a trial runs alike under it (torchrun leaves one rank of a trial every core
        of the machine, and a user's stack does not set its threads as raybench's own loop does)."""
        return {"OMP_NUM_THREADS": str(max(1, int(self.config.resources.cpus_per_worker)))}

    def worker_env(self) -> dict[str, str]:
        """Variables a trial's workers get on top of the launcher's: train.env plus the compile cache directory.

        Launchers set them when they start the workers (torchrun's subprocess env, Ray Train's worker runtime
        env), before any process group or communicator exists, so NCCL_* settings take effect for this trial.
        """
        return {**self.start_env(), **self.compile_cache_env()}

    def start_env(self) -> dict[str, str]:
        """The part of worker_env that must be in place when a worker process starts (libraries read it once)."""
        env = dict(self.config.train.env)
        on_cpu = self.config.resources.gpus_per_worker == 0
        if on_cpu and kind(self.config.stack.kind).own_loop:
            # A CPU trial's memory figure is its peak RSS. glibc raises its mmap threshold each time a large block
            # is freed, after which large tensors come from heap arenas it keeps resident: the peak then depends
            # on the process's allocation history (ranks of one trial differed by 0.1 GiB, a warm actor from a
            # fresh process by 25%). Fixed at glibc's own initial value, every block over 128 KiB is mapped
            # and returned on free, and peak RSS follows live memory (docs/metrics.md). That costs a mapping and
            # its page faults per large allocation: train.env's value replaces it, and an empty one removes it.
            # raybench's own loop only: a user's stack runs no warm actor, and its script must time as it does
            # started by hand, which the threshold slowed 1.3x to 2x (docs/results/inside-outside-2026-11-28.md).
            env.setdefault(MALLOC_MMAP_THRESHOLD, str(MALLOC_MMAP_THRESHOLD_BYTES))
        if env.get(MALLOC_MMAP_THRESHOLD) == "":  # none: glibc would read "" as 0
            del env[MALLOC_MMAP_THRESHOLD]
        if self.config.train.parallelism.zero and on_cpu:
            env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed picks its accelerator once, at its first import
        return env

    def compile_cache_env(self) -> dict[str, str]:
        """The compile cache's variables: inductor and Triton read them whenever they compile, not at start, so a
        warm pool actor sets them for the trial alone and serves eager and compiled trials alike."""
        cache_dir = self.compile_cache_dir()
        if not cache_dir:
            return {}
        return {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton")}
