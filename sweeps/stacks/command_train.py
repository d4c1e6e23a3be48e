"""Your own training script as a `command` stack (sweeps/stack-command-cpu.yaml): your own loop, plain torch DDP
on the ranks torchrun starts, each optimizer step reported to raybench's probe. The probe needs torch and
raybench's source only (the command stack puts raybench on PYTHONPATH), so a script like this runs in any Python
environment; this one builds its model with transformers: the 'tiny' preset's Llama, which the sweep's
model.preset names (the row's FLOPs come from its shape and the parameters the script reports).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from raybench.runtime.probe import StepProbe
from raybench.spec.presets import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    shape = PRESETS["tiny"]
    model = DistributedDataParallel(LlamaForCausalLM(LlamaConfig(**shape.hf_config_kwargs())))
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = torch.Generator().manual_seed(dist.get_rank())  # each rank draws its own batches

    probe = StepProbe()
    probe.count_params(model)  # what trains (here all of it): the row's params_trainable, FLOPs per token and MFU
    probe.start()  # right before the first step
    for _ in range(args.steps):
        batch = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq_len), generator=data)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # This rank's tokens in the optimizer step (all its micro-batches), and the step's loss.
        probe.step(tokens=batch.numel(), loss=loss.detach())
    probe.finish()  # writes this rank's record where the trial reads it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
