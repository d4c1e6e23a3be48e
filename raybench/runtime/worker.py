"""The per-rank benchmark: init → model → techniques → strategy → timed loop → metrics (rank 0 returns them).

Runs under any launcher that sets up torch.distributed: Ray Train workers, or plain torchrun:
    torchrun --standalone --nproc-per-node 2 -m raybench.runtime.worker payload.json result.json
"""

from __future__ import annotations

import os

# Never reach for a model hub from a worker: models and tokenizers come from local directories only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from raybench.planning.payload import TrialPayload  # noqa: E402
from raybench.runtime import (  # noqa: E402
    bench, cuda_snapshot, data, fingerprint, limits, probe, rank_metrics, strategies, weights)
from raybench.runtime.model import build_meta, count_params, fill  # noqa: E402
from raybench.runtime.rank_metrics import Peaks, RankMeasurement, TrialFacts  # noqa: E402
from raybench.runtime.sampler import Sampler  # noqa: E402
from raybench.runtime.strategies import RankContext  # noqa: E402
from raybench.runtime.techniques import activation_checkpointing, compile, liger, lora, qlora  # noqa: E402
from raybench.spec import metrics  # noqa: E402
from raybench.spec.hardware import peak_tflops  # noqa: E402
from raybench.spec.presets import ModelShape, model_shape  # noqa: E402
from raybench.spec.schema import GIB  # noqa: E402
from raybench.spec.sweep_spec import TrainSpec, TrialConfig  # noqa: E402

# Steps with and steps without gradient reduction run after the timed window to measure exposed communication.
COMM_PAIRS = 3
# The one order of model transformations that composes: Liger → 4-bit base (QLoRA) → LoRA → AC → compile.
# Liger and quantization first: they swap the model's own modules and forwards, which LoRA then wraps (PEFT
# puts adapters around whatever Linear/Linear4bit it finds). LoRA before checkpointing: adapters must exist
# before the blocks are wrapped, so that they are inside each block's checkpoint and compiled graph.
# Checkpointing before compile: the compiled graph then contains the checkpoint boundary and can plan the
# recomputation itself (not under TP, where torch 2.13 cannot: compile.compiled_region). Sharding/wrapping (the
# strategy) comes last, in the caller, because it must see the final modules and parameters: anything swapped in
# later would escape sharding and gradient reduction.
TECHNIQUES = (liger, qlora, lora, activation_checkpointing, compile)


def local_device(config: TrialConfig) -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK (set by torchrun and Ray Train), or the CPU."""
    if config.resources.gpus_per_worker > 0:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(config: TrialConfig, timeout_s: float = 1800) -> RankContext:
    """Join the process group the launcher prepared (Ray Train) or create it from torchrun's env."""
    device = local_device(config)
    use_gpu = device.type == "cuda"
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("resources.gpus_per_worker=1 but CUDA is not available on this worker")
    if use_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device)


def prepare_model(model: nn.Module, train: TrainSpec) -> nn.Module:
    """Apply every technique the trial asks for, in TECHNIQUES order (each: wanted(train), apply(model, train))."""
    for technique in TECHNIQUES:
        if technique.wanted(train):
            model = technique.apply(model, train)
    return model


# Resident host memory when this process began its first trial (raybench imported, nothing else done yet).
_FIRST_TRIAL_RSS_GIB: float | None = None


def held_from_earlier_trials_gib() -> float:
    """Host memory this process holds from earlier trials (0 in a fresh process): in a warm pool actor the
    weights and tokenized-data caches, libraries earlier trials imported, the allocator's retained pages. Host
    peaks are reported net of it and the memory cap applies on top of it, so that a warm row says what a fresh
    process would (docs/executors.md)."""
    global _FIRST_TRIAL_RSS_GIB
    rss_gib = _current_host_memory_gib()
    if _FIRST_TRIAL_RSS_GIB is None:
        _FIRST_TRIAL_RSS_GIB = rss_gib
    return max(0.0, rss_gib - _FIRST_TRIAL_RSS_GIB)


def _cache_gib() -> float:
    """The weights and tokenized-data caches a warm pool actor keeps for later trials."""
    return (weights.STATE_CACHE.nbytes() + data.memory_cache_bytes()) / GIB


def _reset_peaks(device: torch.device) -> tuple[float, float]:
    """Start new peak-memory windows (host RSS, and CUDA's allocator on GPUs); returns the RSS and its
    file-backed part now, in GiB."""
    # Writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS on Linux. Without it the training peak
    # would be the process's (build and, in a warm actor, earlier trials included): fail rather than mislead.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak host memory counter ({err}): raybench workers need Linux with a "
                           "writable /proc/self/clear_refs") from None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return _peak_host_memory_gib() or 0.0, limits.proc_status_gib("RssFile") or 0.0


def _peaks(device: torch.device, held_gib: float, file_at_reset_gib: float, gpu_held_gib: float = 0.0) -> Peaks:
    """This rank's peaks since the last reset. Host: net of `held_gib` (kept from earlier trials) and of the
    file-backed pages first touched in the window: library code that a fresh process faults in when it first
    runs it and a warm actor has resident already. Those pages are the shared
    library file's, one copy per node however many ranks run it. GPU: net of `gpu_held_gib`, the tensors
    still allocated before this trial's build (what earlier trials of a warm actor left; 0 in a fresh process)."""
    on_gpu = device.type == "cuda"
    code_gib = max(0.0, (limits.proc_status_gib("RssFile") or 0.0) - file_at_reset_gib)
    return Peaks(rss_gib=(_peak_host_memory_gib() or 0.0) - held_gib - code_gib,
                 alloc_gib=torch.cuda.max_memory_allocated(device) / GIB - gpu_held_gib if on_gpu else None,
                 reserved_gib=torch.cuda.max_memory_reserved(device) / GIB - gpu_held_gib if on_gpu else None)


def _gpu_allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0.0


def _peak_host_memory_gib() -> float | None:
    return limits.proc_status_gib("VmHWM")


def _current_host_memory_gib() -> float:
    return limits.proc_status_gib("VmRSS") or 0.0


def run(payload: TrialPayload) -> dict | None:
    """Benchmark one trial on this rank. Rank 0 returns the metrics; the other ranks return None.

    Running out of memory re-raises with the memory in use at that moment, so the oom row says how much.
    """
    held_gib = held_from_earlier_trials_gib()
    prepare_process(payload.config)
    try:
        with _recording(payload), compile.trial_scope(payload.config.train):
            return _benchmark(payload, held_gib)
    except (RuntimeError, MemoryError) as err:
        # CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError ("can't allocate memory").
        if not isinstance(err, (torch.OutOfMemoryError, MemoryError)) and "can't allocate memory" not in str(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"OutOfMemoryError on rank {rank} with {_memory_in_use()}: {err}") from None


def _recording(payload: TrialPayload):
    """The CUDA allocator's history of this rank, when RAYBENCH_CUDA_MEMORY_SNAPSHOT asks for it (cuda_snapshot)."""
    directory = cuda_snapshot.requested()
    if directory is None:
        return contextlib.nullcontext()
    device = local_device(payload.config)
    return cuda_snapshot.recording(directory, device, f"{payload.trial_id}-{socket.gethostname()}-gpu{device.index}")


def prepare_process(config: TrialConfig) -> None:
    """Import the libraries the trial uses and create the CUDA context, before any clock starts (so that
    model_build_s, wrap_s, compile_s and time_to_first_step_s mean the same in every executor, docs/metrics.md).
    `warm_up` then runs the trial's own path once on a miniature, once the process group exists."""
    train = config.train
    model_type = model_shape(config).model_type
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    wanted = {"deepspeed": train.strategy == "deepspeed", "torch._inductor.compile_fx": train.compile,
              "liger_kernel.transformers": train.liger, "bitsandbytes": train.finetune == "qlora"}
    use_gpu = config.resources.gpus_per_worker > 0
    if wanted["deepspeed"] and not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at its first import
    for module, needed in wanted.items():
        # A missing optional package is left to the technique that needs it, which says how to install it.
        if needed and importlib.util.find_spec(module.split(".")[0]) is not None:
            importlib.import_module(module)
    if use_gpu and torch.cuda.is_available():
        torch.empty(1, device=local_device(config))


WARM_UP_TOKENS = 16


def miniature_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """The trial's architecture at two blocks and a width of a few heads, still divisible by its TP size."""
    kv_heads = max(2, tp_size)
    hidden = 2 * kv_heads * 8  # twice as many query heads as key/value heads (grouped-query), head_dim 8
    return dataclasses.replace(shape, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2 * kv_heads,
                               num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=256,
                               max_position_embeddings=WARM_UP_TOKENS)


def warm_up(payload: TrialPayload, ctx: RankContext, shape: ModelShape) -> float:
    """One training step of the trial's own path — its techniques, its strategy's wrap, forward, backward and
    optimizer step — on a miniature of its architecture, before any clock or memory baseline; returns seconds.

    Libraries set things up on first use and keep them: submodules imported on demand, ABC and regex caches,
    the source lines of warnings, PEFT's conversion tables, the math libraries' workspaces, communication
    buffers. A warm actor's later trial finds them ready, and a fresh process would build them inside its
    build, wrap and first step, and count them in its host peak (docs/results/warm-fidelity-2026-11-25.md). After
    the warm-up both start from the same state. Then the heap that exists is frozen out of the garbage
    collector's scans, so collections during the trial cost the same, and the global random generators are
    seeded with the trial's seed (dropout draws from them; a warm actor's would be wherever earlier trials left
    them). A compiled trial compiles the miniature too: the compiler's first use in a process (inductor's modules,
    its code caches, its worker pool) would otherwise land in a fresh process's training peak and not in a warm
    actor's; its compiled graphs are then dropped, so the trial compiles its own shapes from a clean state.
    """
    t0 = time.perf_counter()
    train = payload.config.train.model_copy(update={"seq_len": WARM_UP_TOKENS, "micro_batch": 1, "grad_accum": 1})
    mini = miniature_shape(shape, train.tp_size)
    config = payload.config.model_copy(update={"train": train})
    trainable = build_and_wrap(payload.replace(config=config, weights_cache_gib=0.0), ctx, mini).trainable
    ids = torch.randint(0, mini.vocab_size, (1, WARM_UP_TOKENS), generator=torch.Generator().manual_seed(0))
    bench.train_step(trainable, iter([{"input_ids": ids, "labels": ids}]), train, ctx.device,
                     bench.PhaseClock(ctx.device))
    del trainable
    if train.compile:
        torch.compiler.reset()
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    gc.freeze()
    torch.manual_seed(payload.config.train.seed)
    return time.perf_counter() - t0


def _memory_in_use() -> str:
    host = f"host RSS peak {_peak_host_memory_gib() or 0:.2f} GiB"
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return host
    device = torch.cuda.current_device()
    return (f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB reserved on GPU {device}, {host}")


def _exposed_comm(trainable, batches, train: TrainSpec, ctx: RankContext) -> float | None:
    """Exposed gradient communication of DDP across ranks: backward with reduction minus backward without.

    Only DDP can skip its reduction without changing the work or the memory of the step (FSDP2 would keep
    unsharded gradients, TP's collectives sit in the forward): other strategies record null.
    """
    if train.strategy != "ddp" or ctx.world_size == 1:
        return None
    synced, local = bench.backward_with_and_without_sync(trainable, batches, train, ctx.device, COMM_PAIRS)
    synced, local = (rank_metrics.mean_over_ranks(t, ctx.device) for t in (synced, local))
    return max(0.0, metrics.percentile(synced, 50) - metrics.percentile(local, 50))


@dataclass(frozen=True)
class Built:
    trainable: strategies.Trainable
    params_total: int  # before sharding
    params_trainable: int
    weights_info: dict  # weights_cache, weights_copy_s
    model_build_s: float  # meta build, techniques and giving the model its values
    wrap_s: float  # the strategy's own setup


def build_and_wrap(payload: TrialPayload, ctx: RankContext, shape: ModelShape | None = None) -> Built:
    """Architecture on the meta device → techniques → the strategy, which calls `materialize` to give the model
    its values: whole before it wraps (ddp, ZeRO-1/2), or after a sharding wrap (fsdp2, tp, tp_fsdp2) or ZeRO-3's
    partitioning only this rank's shards. shape: another architecture, random-initialized (the warm-up)."""
    train = payload.config.train
    t0 = time.perf_counter()
    model, source, weights_info = build_meta(payload.config.model, train.seed,
                                             local_copy=payload.caches.weights_local_copy,
                                             cache_gib=payload.weights_cache_gib, shape=shape)
    if train.finetune == "qlora":  # bitsandbytes quantizes real weights: the (ddp-only) base is whole first
        fill(model, ctx.device, source, weights_info, whole=True)
        torch.manual_seed(train.seed)  # PEFT's adapter init then draws the same numbers on every rank
    model = prepare_model(model, train)
    params_total, params_trainable = count_params(model)
    materialize_s = []

    def materialize(whole: bool) -> None:
        if train.finetune != "qlora":
            t_fill = time.perf_counter()
            fill(model, ctx.device, source, weights_info, whole)
            materialize_s.append(time.perf_counter() - t_fill)

    t_wrap = time.perf_counter()
    trainable = strategies.setup(train.strategy, model, train, ctx, materialize)
    wrap_s = time.perf_counter() - t_wrap - sum(materialize_s)
    return Built(trainable, params_total, params_trainable, weights_info, t_wrap - t0 + sum(materialize_s), wrap_s)


def _benchmark(payload: TrialPayload, held_gib: float) -> dict | None:
    t_start = time.perf_counter()
    config: TrialConfig = payload.config
    train = config.train
    limits.apply_memory_limit(config.resources.memory_limit_gib, int(held_gib * GIB))
    # A collective stuck past the trial's budget fails on its own too, not only by the launcher's kill.
    ctx = init_distributed(config, timeout_s=config.resources.timeout_s)
    shape = model_shape(config)
    hostnames = [None] * ctx.world_size
    dist.all_gather_object(hostnames, fingerprint.hardware(ctx.device)["hostname"])
    # Measured before the model and the warm-up, so its buffers neither compete for memory nor count in the
    # peaks, and are long released when the baseline is read (gloo frees a collective's scratch buffers when its
    # work object goes, which can be after the call returned). Only trials run for a store (which holds the
    # per-cluster cache) probe; bare worker runs skip it.
    busbw = {}
    if ctx.world_size > 1 and payload.cache_dir:
        busbw = probe.cached_measure(ctx.device, ctx.rank, ctx.world_size, hostnames, payload.cache_dir)
    t_start += warm_up(payload, ctx, shape)  # not part of the trial's setup: time_to_first_step_s leaves it out
    # Free heap that glibc kept (the probe's and the warm-up's buffers) goes back to the system before the
    # baseline, as a warm pool actor's does after each trial: trimmed later, it would make the training's growth
    # over the baseline too small, even negative (a fresh row once came out 0.24 GiB under, about the probe's
    # largest buffer).
    limits.release_free_heap()
    rss_at_reset_gib, file_at_reset_gib = _reset_peaks(ctx.device)
    rss_before_build_gib = rss_at_reset_gib - held_gib
    gpu_held_gib = _gpu_allocated_gib(ctx.device)
    cache_before_build_gib = _cache_gib()

    built = build_and_wrap(payload, ctx)
    trainable = built.trainable
    # The build's peaks are its own columns; the peaks a trial reports (and the estimate is checked against)
    # are those of training, from here on.
    build_peaks = _peaks(ctx.device, held_gib, file_at_reset_gib, gpu_held_gib)
    _, file_at_reset_gib = _reset_peaks(ctx.device)
    cuda_snapshot.mark_training_start(ctx.device)
    # The build of a warm actor's first trial on a model fills its weights cache: held for later trials.
    held_gib += _cache_gib() - cache_before_build_gib
    # Ranks of one tensor-parallel group share a batch: data is drawn per data-parallel rank.
    dp_rank, dp_size = strategies.data_parallel_rank(train, ctx)
    batches = data.batches(config, shape, dp_rank, dp_size, payload.cache_dir)

    t_loop = time.perf_counter()
    sampler = Sampler(ctx.device.index if ctx.device.type == "cuda" else None)
    dynamo_before = compile.dynamo_counts() if train.compile else None
    record = bench.timed_loop(trainable, batches, train, ctx.device, sampler)
    compiled = compile.compiled_since(dynamo_before) if train.compile else dict.fromkeys(compile.COLUMNS)
    sampler.close()
    comm_exposed_p50_s = _exposed_comm(trainable, batches, train, ctx)
    measured = RankMeasurement(
        loop=record, sampled=sampler.means(since=record.step_starts[train.warmup_steps]),
        peaks=_peaks(ctx.device, held_gib, file_at_reset_gib, gpu_held_gib), build_peaks=build_peaks,
        rss_before_build_gib=rss_before_build_gib, host_held_gib=held_gib,
        model_build_s=built.model_build_s, wrap_s=built.wrap_s,
        time_to_first_step_s=t_loop - t_start + record.step_times_s[0])
    reduced = rank_metrics.reduce_ranks(measured, train.tp_size, train.warmup_steps, ctx.device)
    if ctx.rank != 0:
        return None

    hardware = fingerprint.hardware(ctx.device)
    flops_tok = metrics.flops_per_token(
        metrics.matmul_params(built.params_total, shape.vocab_size, shape.hidden_size, shape.tie_word_embeddings),
        built.params_trainable, train.finetune == "full", shape.num_hidden_layers, train.seq_len, shape.hidden_size,
    )
    facts = TrialFacts(
        train=train, world_size=ctx.world_size, dp_size=dp_size, params_total=built.params_total,
        params_trainable=built.params_trainable, flops_per_token=flops_tok,
        peak_tflops=peak_tflops(hardware["gpu_name"], train.precision), comm_exposed_p50_s=comm_exposed_p50_s,
        worker_wall_s=time.perf_counter() - t_start, process_trial_index=payload.process_trial_index,
        compiled=compiled, **built.weights_info)
    provenance = {
        "world_size": ctx.world_size,
        "hostnames": sorted(set(hostnames)),
        "allreduce_busbw_gbps": max(busbw.values()) if busbw else None,
        "allreduce_busbw_json": json.dumps(busbw) if busbw else None,
        "env": fingerprint.captured_env(),
        "data_fs_type": fingerprint.filesystem_of(config.data.path or config.model.path or os.getcwd()),
        **hardware,
        **fingerprint.software(),
    }
    return {**dataclasses.asdict(rank_metrics.trial_metrics(reduced, facts)), **provenance}


def main(argv: list[str]) -> int:
    """torchrun entry point: read the payload JSON, run, and have rank 0 write the result JSON."""
    payload_path, result_path = argv
    result = run(TrialPayload.from_dict(json.loads(Path(payload_path).read_text())))
    if result is not None:
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(result))
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
