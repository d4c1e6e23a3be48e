"""The per-rank benchmark: init → the model built and wrapped (`runtime.build`), in its own memory window → timed
loop → metrics (rank 0 returns its `RankResult`).

Runs under any launcher that sets up torch.distributed: Ray Train workers, or plain torchrun:
    torchrun --standalone --nproc-per-node 2 -m raybench.runtime.worker payload.json result.json
"""

from __future__ import annotations

import os

# Never reach for a model hub from a worker: models and tokenizers come from local directories only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from raybench.runtime import (  # noqa: E402
    bench, collectives, cuda_snapshot, data, fingerprint, limits, provenance, rank_memory, rank_metrics,
    rank_progress, stacks, step_profile, strategies, warm_up)
from raybench.runtime.build import Built, build_and_wrap  # noqa: E402
from raybench.runtime.probe import LoopRecord  # noqa: E402
from raybench.runtime.rank_metrics import Peaks, RankMeasurement, TrialFacts  # noqa: E402
from raybench.runtime.sampler import Sampler  # noqa: E402
from raybench.runtime.strategies import RankContext  # noqa: E402
from raybench.runtime.techniques import compile, fp8  # noqa: E402
from raybench.spec import metrics  # noqa: E402
from raybench.spec.hardware import peak_tflops  # noqa: E402
from raybench.spec.payload import TrialPayload  # noqa: E402
from raybench.spec.presets import ModelShape, model_shape  # noqa: E402
from raybench.spec.schema import GIB, RankResult  # noqa: E402
from raybench.spec.stacks import kind  # noqa: E402
from raybench.spec.sweep_spec import TrainSpec, TrialConfig  # noqa: E402

# Steps without gradient reduction after the timed window (whose steps reduce), for the exposed communication.
LOCAL_STEPS = 3
def run(payload: TrialPayload) -> RankResult | None:
    """Benchmark one trial on this rank. Rank 0 returns the result; the other ranks return None.

    Running out of memory re-raises with the memory in use at that moment, so the oom row says how much.
    """
    if not kind(payload.config.stack.kind).own_loop:  # the user's own stack, measured by the probe
        return stacks.run(payload)
    held_gib = rank_memory.held_from_earlier_trials_gib()
    warm_up.prepare_process(payload.config)
    try:
        with _recording(payload), compile.trial_scope(payload.config.train):
            return _benchmark(payload, held_gib)
    except (RuntimeError, MemoryError) as err:
        # CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError ("can't allocate memory").
        if not isinstance(err, (torch.OutOfMemoryError, MemoryError)) and "can't allocate memory" not in str(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"OutOfMemoryError on rank {rank} with {rank_memory.memory_in_use()}: {err}") from None


def _recording(payload: TrialPayload):
    """The CUDA allocator's history of this rank, when RAYBENCH_CUDA_MEMORY_SNAPSHOT asks for it (cuda_snapshot)."""
    directory = cuda_snapshot.requested()
    if directory is None:
        return contextlib.nullcontext()
    device = warm_up.local_device(payload.config)
    return cuda_snapshot.recording(directory, device, f"{payload.trial_id}-{socket.gethostname()}-gpu{device.index}")


def _exposed_comm(trainable, batches, train: TrainSpec, ctx: RankContext, record: LoopRecord) -> float | None:
    """Exposed gradient communication of DDP across ranks: the timed steps' backward (with reduction) minus the
    backward of steps without it.

    Only DDP can skip its reduction without changing the work or the memory of the step (FSDP2 would keep
    unsharded gradients, TP's collectives sit in the forward): other strategies record null.
    """
    if not train.parallelism.reducer or ctx.world_size == 1:
        return None
    synced = record.phase_times_s["backward"][train.warmup_steps:]
    local = bench.backward_without_sync(trainable, batches, train, ctx.device, LOCAL_STEPS)
    synced, local = (rank_metrics.mean_over_ranks(t, ctx.device) for t in (synced, local))
    return max(0.0, metrics.percentile(synced, 50) - metrics.percentile(local, 50))


@dataclass
class _MemoryBaseline:
    """What a rank's memory figures for the trial are net of (rank_memory.peaks)."""

    held_gib: float  # host memory held from earlier trials, the caches this trial's build filled included
    file_at_reset_gib: float  # file-backed resident memory when the current peak window began
    gpu_held_gib: float  # GPU memory allocated before the build
    rss_before_build_gib: float


def _build_measured(payload: TrialPayload, ctx: RankContext, held_gib: float) -> tuple[Built, Peaks, _MemoryBaseline]:
    """The trial's build with its own peak window; returns the build, its peaks, and the baseline of the training
    window, which starts when this returns."""
    # Free heap that glibc kept (the probe's and the warm-up's buffers) goes back to the system before the
    # baseline, as a warm pool actor's does after each trial: trimmed later, it would make the training's growth
    # over the baseline too small, even negative (a fresh row once came out 0.24 GiB under, about the probe's
    # largest buffer).
    limits.release_free_heap()
    rss_at_reset_gib, file_at_reset_gib = rank_memory.reset_peaks(ctx.device)
    baseline = _MemoryBaseline(held_gib, file_at_reset_gib, rank_memory.gpu_allocated_gib(ctx.device),
                               rss_before_build_gib=rss_at_reset_gib - held_gib)
    cache_before_build_gib = rank_memory.cache_gib()
    built = build_and_wrap(payload, ctx)
    # The build's peaks are its own columns; the peaks a trial reports (and the estimate is checked against)
    # are those of training, from here on.
    build_peaks = _peaks(ctx.device, baseline)
    _, baseline.file_at_reset_gib = rank_memory.reset_peaks(ctx.device)
    cuda_snapshot.mark_training_start(ctx.device)
    # The build of a warm actor's first trial on a model fills its weights cache: held for later trials.
    baseline.held_gib += rank_memory.cache_gib() - cache_before_build_gib
    return built, build_peaks, baseline


def _peaks(device: torch.device, baseline: _MemoryBaseline) -> Peaks:
    return rank_memory.peaks(device, baseline.held_gib, baseline.file_at_reset_gib, baseline.gpu_held_gib)


@dataclass(frozen=True)
class _Trained:
    measured: RankMeasurement
    compiled: dict  # compile.COLUMNS; empty when eager
    comm_exposed_p50_s: float | None
    dp_size: int
    profile: dict  # step_profile.COLUMNS; empty when train.profile_steps is 0
    comm_bus_gb_per_step: float | None  # rank 0's collectives in the timed loop (collectives.bus_gb_per_step)


def _train_measured(payload: TrialPayload, ctx: RankContext, shape: ModelShape, built: Built, build_peaks: Peaks,
                    baseline: _MemoryBaseline, t_start: float, marks: rank_progress.Marks) -> _Trained:
    """The timed loop, then the exposed-communication steps, then the profiled steps; this rank's
    measurements."""
    config, train = payload.config, payload.config.train
    # Ranks of one tensor-parallel group share a batch: data is drawn per data-parallel rank.
    dp_rank, dp_size = strategies.data_parallel_rank(train, ctx)
    batches = data.batches(config, shape, dp_rank, dp_size, payload.cache_dir, payload.tokenized)
    t_loop = time.perf_counter()
    sampler = Sampler(ctx.device.index if ctx.device.type == "cuda" else None)
    dynamo_before = compile.dynamo_counts() if train.compile else None
    sent_before = collectives.marks() if ctx.rank == 0 else {}
    record = bench.timed_loop(built.trainable, batches, train, ctx.device, sampler, on_step=marks.step)
    comm_bus = collectives.bus_gb_per_step(sent_before, train.steps) if ctx.rank == 0 else None
    marks.reached("after the timed steps")
    compiled = compile.compiled_since(dynamo_before) if train.compile else {}
    sampler.close()
    comm_exposed_p50_s = _exposed_comm(built.trainable, batches, train, ctx, record)
    measured = RankMeasurement(
        loop=record, sampled=sampler.means(since=record.step_starts[train.warmup_steps]),
        peaks=_peaks(ctx.device, baseline), build_peaks=build_peaks,
        rss_before_build_gib=baseline.rss_before_build_gib, host_held_gib=baseline.held_gib,
        model_build_s=built.model_build_s, wrap_s=built.wrap_s,
        time_to_first_step_s=t_loop - t_start + record.step_times_s[0])
    # Last, after the peaks are read: the profiled steps change no timing or memory figure of the row.
    profile = step_profile.profile_training(built.trainable, batches, train, ctx.device, reduce=ctx.rank == 0)
    return _Trained(measured, compiled, comm_exposed_p50_s, dp_size, profile, comm_bus)


def _trial_facts(payload: TrialPayload, ctx: RankContext, shape: ModelShape, built: Built, trained: _Trained,
                 hardware: dict, t_start: float, hostnames: list[str], busbw: dict) -> TrialFacts:
    train = payload.config.train
    flops_tok = metrics.flops_per_token(
        metrics.matmul_params(built.params_total, shape.vocab_size, shape.hidden_size, shape.tie_word_embeddings),
        built.params_trainable, train.tuning.trains_base, shape.num_hidden_layers, train.seq_len, shape.hidden_size,
    )
    return TrialFacts(
        train=train, world_size=ctx.world_size, dp_size=trained.dp_size, params_total=built.params_total,
        params_trainable=built.params_trainable, flops_per_token=flops_tok,
        peak_tflops=peak_tflops(hardware["gpu_name"], train.precision), comm_exposed_p50_s=trained.comm_exposed_p50_s,
        worker_wall_s=time.perf_counter() - t_start, process_trial_index=payload.process_trial_index,
        compiled=trained.compiled, **built.weights_info,
        fp8=fp8.columns(built.fp8_linears, train.tuning.trains_base, flops_tok) if fp8.wanted(train) else {},
        profile=trained.profile, comm_bus_gb_per_step=trained.comm_bus_gb_per_step,
        allreduce_busbw_gbps=max(busbw.values()) if busbw else None,
        link_gbps=provenance.nominal_link_gbps(hardware["gpu_name"], hostnames))


def _benchmark(payload: TrialPayload, held_gib: float) -> RankResult | None:
    t_start = time.perf_counter()
    config: TrialConfig = payload.config
    limits.apply_memory_limit(config.resources.memory_limit_gib, int(held_gib * GIB))
    # A collective stuck past the trial's budget fails on its own too, not only by the launcher's kill.
    ctx = warm_up.init_distributed(config, timeout_s=config.resources.timeout_s)
    # How far this rank gets, for a timeout row (rank_progress.describe): slow or hung.
    marks = rank_progress.Marks(payload.cache_dir, payload.trial_id, ctx.rank, config.train.steps)
    marks.reached("warm-up")
    shape = model_shape(config)
    hostnames, busbw = provenance.hostnames_and_busbw(payload, ctx)
    nccl = provenance.transport_check(ctx, hostnames)
    # Not part of the trial's setup: time_to_first_step_s leaves it out.
    t_start += warm_up.warm_up(payload, ctx, shape, build_and_wrap)
    marks.reached("build")
    built, build_peaks, baseline = _build_measured(payload, ctx, held_gib)
    marks.reached("first step")
    trained = _train_measured(payload, ctx, shape, built, build_peaks, baseline, t_start, marks)
    reduced = rank_metrics.reduce_ranks(trained.measured, config.train.tp_size, config.train.warmup_steps)
    if ctx.rank != 0:
        return None
    hardware = fingerprint.hardware(ctx.device)
    facts = _trial_facts(payload, ctx, shape, built, trained, hardware, t_start, hostnames, busbw)
    return rank_metrics.rank_result(reduced, facts, provenance.columns(config, ctx, hostnames, busbw, hardware, nccl))


def main(argv: list[str]) -> int:
    """torchrun entry point: read the payload JSON, run, and have rank 0 write the result JSON
    (`RankResult.to_dict`)."""
    payload_path, result_path = argv
    result = run(TrialPayload.from_dict(json.loads(Path(payload_path).read_text())))
    if result is not None:
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(result.to_dict()))
        tmp.replace(result_path)
    # Tear gloo down together: a rank that destroys its group while rank 0 is still finishing up made the
    # process abort at exit ("terminate called without an active exception") in about 1 run in 8.
    dist.barrier()
    dist.destroy_process_group()
    # The barrier made the abort rarer but not gone (seen in CI, FSDP2 + LoRA): it comes from C++ threads
    # destroyed during interpreter shutdown. Every result is written and every rank is done: skip that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
