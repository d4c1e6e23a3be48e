"""Layer 4, the runtime on a rank: what one training process does, under any launcher (Ray or plain torchrun).

`worker` (init → model → techniques → strategy → timed loop → measurements), `strategies/` (ddp, fsdp2,
deepspeed, tp, tp_fsdp2) and `techniques/` (liger, qlora, lora, activation checkpointing, compile), `model`,
`materialize` and `weights` (building and filling the model), `data` (batches from the rows the driver
prepared), `bench` (the timed loop), `rank_metrics`, `fingerprint`, `allreduce` (bus bandwidth), `probe` (step
timing for any loop), `sampler`, `limits`, `cuda_snapshot`, `isolation` (what a warm actor puts back between
trials), `stacks/` (the user's own training stacks). Imports `spec` and `data` only (its trial comes as
`spec.payload.TrialPayload`): no plan, no Ray, no results store (no pyarrow).
"""
