"""The rehearsal's tiny trials and the cases both a fake rank and real gloo ranks run: shared by
tests/unit/test_rehearse*.py and tests/integration/test_rehearse_real_ranks.py."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from raybench.planning.plan import plan
from raybench.rehearse import fake_world, trace
from raybench.runtime.strategies import RankContext
from raybench.spec.load import parse_sweep

# The full loss: these cases were set against real ranks with it; the chunked ones say so (REAL_CASES).
TINY_TRAIN = {"steps": 2, "warmup_steps": 1, "seq_len": 64, "micro_batch": 2, "precision": "bf16", "loss": "full"}
# Rehearsed vs real tensor memory per rank: the bound.
MEMORY_TOLERANCE = 0.10


# Techniques a sweep refuses on CPU, set after planning: trace and real ranks both run them on CPU (Liger's
# reference operators; torchao's Float8Linear through CPU's own _scaled_mm).
REFUSED_ON_CPU = ("liger", "fp8")


def tiny_trial(workers: int, gpus: int = 0, **train):
    after_plan = {name: train.pop(name) for name in REFUSED_ON_CPU if name in train}
    spec = parse_sweep({"name": "rehearse", "model": {"preset": "tiny"}, "train": {**TINY_TRAIN, **train},
                        "resources": {"workers": workers, "gpus_per_worker": gpus}, "estimate": {"gpu": "H100 SXM"}})
    (trial,) = plan(spec)
    if after_plan:
        config = trial.config.model_copy(update={"train": trial.config.train.model_copy(update=after_plan)})
        trial = dataclasses.replace(trial, payload=trial.payload.replace(config=config))
    return trial


def fake_trace(trial, skip_propagation: bool = True, gpu: str | None = None) -> trace.StepTrace:
    fake_world.init_fake_world(0, trial.world_size)
    try:
        ctx = RankContext(0, trial.world_size, 0, torch.device("cpu"))
        return trace.trace_step(trial.config, trial.shape, ctx, fake=True, skip_propagation=skip_propagation,
                                gpu=gpu)
    finally:
        dist.destroy_process_group()


# Real runs of a step; the lowest peak counts. gloo's worker thread lets go of a collective's buffers a moment after
# the wait returns; on a loaded machine that moment can fall after the step's peak, which then counts a buffer the
# step had freed (an all-gather's output held 5 ms longer adds the root's gathered weights to the LoRA cases'
# peak). That only ever adds memory, and two runs both delayed so are unlikely.
REAL_RUNS = 2


def real_trace(trial, ctx: RankContext) -> trace.StepTrace:
    """The trial's step run for real on this rank's process group (REAL_RUNS times: the lowest peak)."""
    runs = [trace.trace_step(trial.config, trial.shape, ctx, fake=False) for _ in range(REAL_RUNS)]
    return min(runs, key=lambda step: step.peak_gib)


LORA_DROPOUT = {"targets": "all_linear", "dropout": 0.1}
# Liger at a longer sequence: at 64 tokens its step (no logits) peaks as backward ends, where a real gloo rank
# still holds the last reduce-scatter's input and the fake rank has let it go (2 MiB of this tiny model). At 256
# tokens the activations peak, which would be 17% over the real ones if the trace built an attention mask
# (trace.one_sequence_per_row).
REAL_CASES = {"fsdp2": {"strategy": "fsdp2"}, "tp": {"strategy": "tp", "tp_size": 2},
              "ddp": {"strategy": "ddp"}, "ddp-lora": {"strategy": "ddp", "finetune": "lora"},
              # Adapters split with their projections: the replicated ones' partial gradients, the joined sums.
              "tp-lora": {"strategy": "tp", "tp_size": 2, "finetune": "lora"},
              # LoRA dropout recomputed in backward (techniques/lora.py): no dropped copies, no masks kept (under
              # tp too: tests/unit/test_lora_dropout.py traces it, tp-lora checks the DTensor adapters' accounting).
              "fsdp2-lora-dropout": {"strategy": "fsdp2", "finetune": "lora", "lora": LORA_DROPOUT},
              "ddp-lora-dropout": {"strategy": "ddp", "finetune": "lora", "lora": LORA_DROPOUT},
              "fsdp2-liger": {"strategy": "fsdp2", "liger": True, "seq_len": 256},
              "ddp-liger": {"strategy": "ddp", "liger": True, "seq_len": 256},
              "tp-liger": {"strategy": "tp", "tp_size": 2, "liger": True, "seq_len": 256},
              # FP8 linears: casts and scales as temporaries, weights all-gathered in FP8 (tensorwise), and under
              # LoRA the base's input kept for a weight gradient torchao computes even for frozen weights.
              "fsdp2-fp8": {"strategy": "fsdp2", "fp8": "tensorwise"},
              "ddp-lora-fp8": {"strategy": "ddp", "finetune": "lora", "fp8": "rowwise"},
              "fsdp2-bf16-reduce": {"strategy": "fsdp2", "reduce_dtype": "bf16"},
              # Two micro-batches per step: the first without gradient sync, the last with it
              # (test_rehearse_accumulation.py).
              "fsdp2-accum": {"strategy": "fsdp2", "grad_accum": 2},
              "fsdp2-lora-accum": {"strategy": "fsdp2", "finetune": "lora", "grad_accum": 2},
              "ddp-accum": {"strategy": "ddp", "grad_accum": 2},
              "tp-accum": {"strategy": "tp", "tp_size": 2, "grad_accum": 2},
              # The chunked loss (train.loss's default): no logits, the head's input gradient kept from forward.
              # fsdp2 at 256 tokens as Liger's cases: at 64 its step peaks as backward ends (see above).
              "fsdp2-chunked-loss": {"strategy": "fsdp2", "loss": "chunked", "seq_len": 256},
              "ddp-lora-chunked-loss": {"strategy": "ddp", "finetune": "lora", "loss": "chunked"}}
