"""The per-rank benchmark: init → model → techniques → strategy → timed loop → metrics (rank 0 returns them).

Runs under any launcher that sets up torch.distributed: Ray Train workers, or plain torchrun:
    torchrun --standalone --nproc-per-node 2 -m raybench.worker payload.json result.json
"""

from __future__ import annotations

import os

# Never reach for a model hub from a worker: models and tokenizers come from local directories only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from raybench import bench, data, fingerprint, metrics, strategies  # noqa: E402
from raybench.config import TrainSpec, TrialConfig  # noqa: E402
from raybench.model import build_model, count_params, decoder_blocks  # noqa: E402
from raybench.plan import model_shape  # noqa: E402
from raybench.strategies import RankContext  # noqa: E402
from raybench.techniques import activation_checkpointing, compile, lora  # noqa: E402

GIB = 2**30


def init_distributed(config: TrialConfig, timeout_s: float = 1800) -> RankContext:
    """Join the process group the launcher prepared (Ray Train) or create it from torchrun's env."""
    use_gpu = config.resources.gpus_per_worker > 0
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("resources.gpus_per_worker=1 but CUDA is not available on this worker")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def prepare_model(model: nn.Module, train: TrainSpec, ac_blocks: list[int]) -> nn.Module:
    """Apply the techniques in the one order that composes: LoRA → activation checkpointing → compile.

    LoRA first: adapters must exist before the blocks are wrapped, so that they are inside each block's
    checkpoint and compiled graph. Checkpointing before compile: the compiled graph then contains the
    checkpoint boundary and can plan the recomputation itself. Sharding/wrapping (the strategy) comes last,
    in the caller, because it must see the final modules and parameters: anything swapped in later would
    escape sharding and gradient reduction.
    """
    if train.finetune == "lora":
        model = lora.apply(model, train.lora)
    blocks = decoder_blocks(model)
    activation_checkpointing.apply(blocks, ac_blocks)
    if train.compile:
        compile.apply(blocks)
    return model


def _reset_peak_host_memory() -> None:
    # Writing 5 to clear_refs resets VmHWM (peak RSS) on Linux, so a reused process measures this trial only.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_host_memory_gib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _reduce(values: list[float], op, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def run(payload: dict) -> dict | None:
    """Benchmark one trial on this rank. Rank 0 returns the metrics; the other ranks return None."""
    t_start = time.perf_counter()
    config = TrialConfig.model_validate(payload["config"])
    train = config.train
    ctx = init_distributed(config)
    shape = model_shape(config)
    _reset_peak_host_memory()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)

    t0 = time.perf_counter()
    model = build_model(config.model, ctx.device, train.seed)
    model_build_s = time.perf_counter() - t0
    model = prepare_model(model, train, payload["ac_blocks"])
    params_total, params_trainable = count_params(model)
    t0 = time.perf_counter()
    trainable = strategies.setup(train.strategy, model, train, ctx)
    wrap_s = time.perf_counter() - t0
    batches = data.batches(config, shape, ctx.rank, ctx.world_size)

    t_loop = time.perf_counter()
    record = bench.timed_loop(trainable, batches, train, ctx.device)

    # A step lasts as long as its slowest rank; losses are averaged over ranks.
    step_times = _reduce(record.step_times_s, dist.ReduceOp.MAX, ctx.device)
    losses = [v / ctx.world_size for v in _reduce(record.losses, dist.ReduceOp.SUM, ctx.device)]
    nonpad = _reduce([float(n) for n in record.nonpad_tokens], dist.ReduceOp.SUM, ctx.device)
    peaks = [_peak_host_memory_gib() or 0.0]
    if ctx.device.type == "cuda":
        peaks += [torch.cuda.max_memory_allocated(ctx.device) / GIB, torch.cuda.max_memory_reserved(ctx.device) / GIB]
    peaks = _reduce(peaks, dist.ReduceOp.MAX, ctx.device)
    hostnames = [None] * ctx.world_size
    dist.all_gather_object(hostnames, fingerprint.hardware(ctx.device)["hostname"])
    if ctx.rank != 0:
        return None

    warm = train.warmup_steps
    timed = step_times[warm:]
    timed_s = sum(timed)
    tokens_per_step = train.micro_batch * train.seq_len * train.grad_accum * ctx.world_size
    tok_per_s = tokens_per_step * len(timed) / timed_s
    hardware = fingerprint.hardware(ctx.device)
    flops_tok = metrics.flops_per_token(
        metrics.matmul_params(params_total, shape.vocab_size, shape.hidden_size, shape.tie_word_embeddings),
        params_trainable, train.finetune == "full", shape.num_hidden_layers, train.seq_len, shape.hidden_size,
    )
    per_device = tok_per_s / ctx.world_size
    peak = metrics.peak_tflops(hardware["gpu_name"], train.precision)
    return {
        **metrics.step_time_stats(timed),
        "steps_timed": len(timed),
        "tokens_per_step": tokens_per_step,
        "tok_per_s": tok_per_s,
        "tok_per_s_per_device": per_device,
        "nonpad_tok_per_s": sum(nonpad[warm:]) / timed_s,
        "nonpad_tok_per_s_per_device": sum(nonpad[warm:]) / timed_s / ctx.world_size,
        "tflops_per_device": per_device * flops_tok / 1e12,
        "mfu": metrics.mfu(per_device, flops_tok, peak),
        "flops_per_token": flops_tok,
        "loss_first": losses[0],
        "loss_final": losses[-1],
        "peak_rss_gib": peaks[0],
        "peak_alloc_gib": peaks[1] if len(peaks) > 1 else None,
        "peak_reserved_gib": peaks[2] if len(peaks) > 2 else None,
        "params_total": params_total,
        "params_trainable": params_trainable,
        "model_build_s": model_build_s,
        "wrap_s": wrap_s,
        "warmup_s": sum(step_times[:warm]),
        "time_to_first_step_s": t_loop - t_start + record.step_times_s[0],
        "worker_wall_s": time.perf_counter() - t_start,
        "world_size": ctx.world_size,
        "hostnames": sorted(set(hostnames)),
        "env": fingerprint.captured_env(),
        **hardware,
        **fingerprint.software(),
    }


def main(argv: list[str]) -> int:
    """torchrun entry point: read the payload JSON, run, and have rank 0 write the result JSON."""
    payload_path, result_path = argv
    result = run(json.loads(Path(payload_path).read_text()))
    if result is not None:
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(result_path)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
