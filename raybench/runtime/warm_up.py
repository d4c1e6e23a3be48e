"""Getting a rank's process ready before any of the trial's clocks or memory baselines start: its device, the
process group, the libraries the trial uses, and one step of the trial's own path on a miniature (the warm-up),
so that a fresh process and a warm pool actor start the trial from the same state (docs/executors.md)."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from raybench.runtime import bench, nccl_log
from raybench.runtime.strategies import RankContext
from raybench.spec.payload import TrialPayload
from raybench.spec.presets import ModelShape, model_shape
from raybench.spec.sweep_spec import TrialConfig

WARM_UP_TOKENS = 16


def local_device(config: TrialConfig) -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK (set by torchrun and Ray Train), or the CPU."""
    if config.resources.gpus_per_worker > 0:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(config: TrialConfig, timeout_s: float = 1800) -> RankContext:
    """Join the process group the launcher prepared (Ray Train, a pool actor) or create it from torchrun's env."""
    device = local_device(config)
    use_gpu = device.type == "cuda"
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("resources.gpus_per_worker=1 but CUDA is not available on this worker")
    if use_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
    if not dist.is_initialized():
        if use_gpu:
            nccl_log.capture()  # NCCL's transport choices, for the row (provenance.transport_check)
        dist.init_process_group("nccl" if use_gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device)


def trial_modules(config: TrialConfig) -> list[str]:
    """The modules a trial imports: the model's modeling module, and the libraries of its strategy and
    techniques that are installed (a missing optional package is left to the technique that needs it, which
    says how to install it)."""
    train = config.train
    model_type = model_shape(config).model_type
    wanted = {"deepspeed": train.parallelism.zero, "torch._inductor.compile_fx": train.compile,
              "liger_kernel.transformers": train.liger, "bitsandbytes": train.tuning.quantized_base}
    optional = [m for m, needed in wanted.items() if needed and importlib.util.find_spec(m.split(".")[0]) is not None]
    return [f"transformers.models.{model_type}.modeling_{model_type}", *optional]


def prepare_process(config: TrialConfig) -> None:
    """Import the libraries the trial uses and create the CUDA context, before any clock starts (so that
    model_build_s, wrap_s, compile_s and time_to_first_step_s mean the same in every executor, docs/metrics.md).
    `warm_up` then runs the trial's own path once on a miniature, once the process group exists."""
    use_gpu = config.resources.gpus_per_worker > 0
    if config.train.parallelism.zero and not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at its first import
    for module in trial_modules(config):
        importlib.import_module(module)
    if use_gpu and torch.cuda.is_available():
        torch.empty(1, device=local_device(config))


def miniature_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """The trial's architecture at two blocks and a width of a few heads, still divisible by its TP size."""
    kv_heads = max(2, tp_size)
    hidden = 2 * kv_heads * 8  # twice as many query heads as key/value heads (grouped-query), head_dim 8
    return dataclasses.replace(shape, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2 * kv_heads,
                               num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=256,
                               max_position_embeddings=WARM_UP_TOKENS)


def warm_up(payload: TrialPayload, ctx: RankContext, shape: ModelShape, build_and_wrap: Callable) -> float:
    """One training step of the trial's own path — its techniques, its strategy's wrap (`build_and_wrap`, the
    trial's own: build.build_and_wrap), forward, backward and optimizer step — on a miniature of its
    architecture, before any clock or memory baseline; returns seconds.

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
