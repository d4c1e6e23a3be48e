"""The distributed strategies a trial can run (`train.strategy`), as typed facts the rest of raybench reads: what
each shards, whether it splits projections over a tensor-parallel group, which techniques it is wired for, and
whether the rehearsal traces it. A strategy's runtime is its module in runtime/strategies/ (same name); nothing
outside this file and that module compares a strategy's name.

To add a strategy: a `Strategy` here (its facts decide the plan's rules, the estimate and the rehearsal), its
runtime module, and its name in `train.strategy`'s choices follows from STRATEGIES.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    fsdp2: bool = False  # FSDP2 shards the parameters; its mixed-precision policy casts them before each forward
    tensor_parallel: bool = False  # the blocks' projections split over a TP group (tp_size ranks)
    tp_group_is_world: bool = False  # every rank in the one TP group (train.tp_size must be the world size)
    zero: bool = False  # DeepSpeed's ZeRO engine: flat fp32 master and states partitioned by train.zero_stage
    reducer: bool = False  # DDP: whole replicas whose reducer all-reduces gradient buckets (a copy of each)
    fp8: bool = False  # torchao's Float8 linears are wired for it (their FSDP2 all-gather included)
    fp16_scaling: bool = False  # fp16 loss scaling is wired (torch's GradScaler, or DeepSpeed's own scaler)
    quantized_base: bool = False  # a QLoRA 4-bit base runs under it (bitsandbytes weights are not sharded)
    traced: bool = True  # the rehearsal traces its step on fake ranks (DeepSpeed's engine needs real storage)

    @property
    def sixteen_bit_weights(self) -> bool:
        """Whether ranks compute on 16-bit copies of the weights (FSDP2's cast, DeepSpeed's model cast) rather than
        on fp32 weights under torch.autocast (ddp, tp)."""
        return self.fsdp2 or self.zero

    @property
    def dtensor_params(self) -> bool:
        """Whether its parameters are DTensors (FSDP2's shards, TP's splits): in-place optimizers that reshape
        their state (torch's Adafactor) reject them."""
        return self.fsdp2 or self.tensor_parallel


DDP = Strategy("ddp", "data-parallel replicas (torch DDP)", reducer=True, fp8=True, fp16_scaling=True,
               quantized_base=True)
FSDP2 = Strategy("fsdp2", "parameters sharded over all ranks (torch FSDP2)", fsdp2=True, fp8=True)
DEEPSPEED = Strategy("deepspeed", "DeepSpeed ZeRO (train.zero_stage)", zero=True, fp16_scaling=True, traced=False)
TP = Strategy("tp", "tensor parallel over all ranks", tensor_parallel=True, tp_group_is_world=True)
TP_FSDP2 = Strategy("tp_fsdp2", "a 2D mesh: tp_size ranks per TP group, FSDP2 across groups", fsdp2=True,
                    tensor_parallel=True)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DDP, FSDP2, DEEPSPEED, TP, TP_FSDP2)}
