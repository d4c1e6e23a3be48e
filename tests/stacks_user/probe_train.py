"""A user's own training script, as a `command` stack runs it: a tiny torch model trained with DDP on gloo ranks
(started by torchrun), each optimizer step timed by raybench's probe. Needs torch and raybench's source only.

--mode ok trains; crash fails after two steps the way a user's bug does; hang stops making progress (the trial's
resources.timeout_s must end it); abort trains, then rank 1 draws a progress bar and dies by SIGABRT the way a C++
thread still running at exit ends a process ("terminate called without an active exception").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raybench.runtime.probe import StepProbe

VOCAB, HIDDEN = 64, 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--mode", choices=("ok", "crash", "hang", "abort"), default="ok")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = DistributedDataParallel(nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = StepProbe()
    probe.count_params(model)  # what trains: the row's params_trainable (and FLOPs, where the model section's)
    probe.start()
    for step in range(args.steps):
        if args.mode == "crash" and step == 2:
            raise ValueError("bad batch shape 7")
        if args.mode == "hang" and step == 2:
            time.sleep(3600)
        batch = torch.randint(0, VOCAB, (args.micro_batch, args.seq_len))
        logits = model(batch)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        probe.step(tokens=batch.numel(), loss=loss.detach())
    probe.finish()
    if args.mode == "abort" and dist.get_rank() == 1:
        _abort_after_a_progress_bar()
    dist.barrier()  # no rank tears its group down while another still talks to it
    dist.destroy_process_group()


def _abort_after_a_progress_bar() -> None:
    for done in range(1, 6):  # a tqdm-like bar: redrawn with carriage returns, one newline at its end
        sys.stderr.write(f"\r{done * 20:3d}%|{'#' * done:<5}| {done}/5 [00:0{done}<00:00, 4.2it/s]")
    sys.stderr.write("\nterminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()


if __name__ == "__main__":
    main()
