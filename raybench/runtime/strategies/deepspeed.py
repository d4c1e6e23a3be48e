"""DeepSpeed ZeRO stage 1/2/3: optimizer state (1), + gradients (2), + parameters (3) partitioned across ranks.

The engine owns backward (loss scaling, gradient partitioning) and step (clipping, optimizer, zeroing), so the
Trainable carries the engine's own functions. The optimizer is a torch optimizer built by raybench: a config
optimizer name ("AdamW") would make DeepSpeed JIT-compile its fused_adam op (minutes, and a compiler on every
worker). On CPU DeepSpeed needs DS_ACCELERATOR=cpu before its first import and the gloo backend; its CPU
communication backend also JIT-builds a shared-memory all-reduce op (`deepspeed_shm_comm`, ~30-90 s with g++)
the first time on a machine and then loads it from the torch extensions cache (TORCH_EXTENSIONS_DIR).

With bf16/fp16 the engine casts the whole module to that dtype (a LoRA base already stored in it stays as it
is; an fp32 base cannot be kept, plan refuses it) and keeps fp32 master copies of the trainable parameters.

ZeRO-1/2 keep whole parameters on every rank: the model is materialized whole before `initialize`. ZeRO-3 is
partitioned from the meta device (`partition_on_meta`): no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from raybench.runtime.strategies import RankContext, Trainable, already_materialized, make_optimizer
from raybench.spec.sweep_spec import TrainSpec

# DeepSpeed prints its config and a throughput line every N steps; a benchmark step must not pay for that.
NEVER_PRINT_STEPS = 2**31 - 1


def ds_config(train: TrainSpec, world_size: int, use_gpu: bool) -> dict:
    """The DeepSpeed config for one trial (batch sizes, ZeRO stage, offload, precision, clipping)."""
    zero: dict = {"stage": train.zero_stage, "overlap_comm": use_gpu, "contiguous_gradients": True}
    if train.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if train.offload == "optimizer_params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch * train.grad_accum * world_size,
        "zero_optimization": zero,
        "steps_per_print": NEVER_PRINT_STEPS,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # torch optimizers (Adafactor, SGD) are fine with ZeRO
    }
    if train.offload != "none" and not _uses_host_adam(train):
        # SGD / Adafactor have no DeepSpeed host kernel: they step on the host as torch optimizers (slower).
        config["zero_force_ds_cpu_optimizer"] = False
    if train.max_grad_norm is not None:
        config["gradient_clipping"] = train.max_grad_norm
    if train.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        # loss_scale 0 = dynamic scaling; a fixed scale of 1 is "no scaler" (plan rejects it for fp16).
        config["fp16"] = {"enabled": True, "loss_scale": 0 if train.grad_scaler else 1}
    return config


def _uses_host_adam(train: TrainSpec) -> bool:
    """Whether the optimizer steps on the host with DeepSpeed's CPU Adam (ZeRO-Offload with AdamW)."""
    return train.offload != "none" and train.optimizer.startswith("adamw")


def host_adam(model: nn.Module, train: TrainSpec):
    """ZeRO-Offload steps AdamW on the host with DeepSpeed's CPU Adam (SIMD C++; DeepSpeed refuses torch's AdamW
    there as too slow). Its op is JIT-built once per machine into TORCH_EXTENSIONS_DIR (needs g++ and ninja)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [p for p in model.parameters() if p.requires_grad]
    return DeepSpeedCPUAdam(params, lr=train.lr, weight_decay=train.weight_decay, adamw_mode=True)


def partition_on_meta(model: nn.Module, config: dict) -> None:
    """Turn a meta model's parameters into ZeRO-3 partitioned parameters: each rank allocates its own partition
    of each (on the device, or the host with parameter offload), not yet filled, and never a whole model.

    This is DeepSpeed's own conversion (what zero.Init does to a module built under it, or to one given as
    `module=`), minus the broadcast of rank 0's values that precedes it there: a meta model has no values yet,
    every rank computes its own partition's (raybench.runtime.materialize). DeepSpeed partitions a tensor by copying
    this rank's range out of it, so each parameter in turn gets a whole-shape placeholder nobody writes: on the
    host its pages are never touched (no memory), on a GPU it is one parameter for a moment.
    The Init object is never entered: entering patches tensor constructors and module classes process-wide (and
    would have to be left before anything else runs); deepspeed.initialize finds every parameter converted.
    """
    from deepspeed import zero

    init = zero.Init(config_dict_or_path=config)  # partition group, dtype and device from the trial's config
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in converted:  # a tied head is the embedding: converted once, shared
                converted[id(param)] = _partitioned(init, param)
            module._parameters[name] = converted[id(param)]
    if init.mem_efficient_linear:
        # What zero.Init(module=...) does too (deepspeed.initialize of a whole model): ZeRO-3 trains with
        # DeepSpeed's linear unless the config turns it off. Process-wide; raybench.runtime.isolation restores it.
        init._enable_mem_efficient_linear()


def _partitioned(init, param: nn.Parameter) -> nn.Parameter:
    """A ZeRO-3 parameter in place of a meta one (a meta tensor cannot take real data in place: to_empty also
    makes new Parameters), holding only this rank's partition."""
    placeholder = torch.empty(param.shape, dtype=init.dtype, device=init.local_device)
    zero_param = nn.Parameter(placeholder, requires_grad=param.requires_grad)
    init._convert_to_deepspeed_param(zero_param)  # private; deepspeed is pinned (constraints.txt), tests cover it
    zero_param.partition()  # allocates the partition, copies this rank's range of the placeholder, frees it
    return zero_param


def setup(model: nn.Module, train: TrainSpec, ctx: RankContext, materialize=already_materialized) -> Trainable:
    use_gpu = ctx.device.type == "cuda"
    if train.offload != "none" and not use_gpu:
        raise ValueError(f"train.offload={train.offload!r} moves ZeRO state from GPU to host memory and needs "
                         "GPUs (resources.gpus_per_worker: 1); on CPU set train.offload: none")
    if not use_gpu:
        # Must precede the first `import deepspeed` anywhere in this process: it picks the accelerator once.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # The process group already exists (torchrun or Ray Train); this wraps it in DeepSpeed's comm layer.
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")
    config = ds_config(train, ctx.world_size, use_gpu)
    if train.zero_stage == 3:
        partition_on_meta(model, config)
        materialize(False)  # fills each partition (raybench.runtime.materialize knows ZeRO-3's layout)
    else:
        materialize(True)  # ZeRO-1/2 keep whole parameters on every rank
    optimizer = host_adam(model, train) if _uses_host_adam(train) else make_optimizer(model, train, ctx.device)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def backward(loss) -> None:
        # The loop already divides the loss by grad_accum. DeepSpeed counts micro-batches through step():
        # on every micro-batch but the last, step() only advances that counter (no optimizer step).
        engine.backward(loss, scale_wrt_gas=False)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()

    # The engine decides itself when to reduce gradients and casts the model for bf16/fp16: no contexts needed.
    return Trainable(engine, optimizer, backward, engine.step, contextlib.nullcontext, contextlib.nullcontext)
