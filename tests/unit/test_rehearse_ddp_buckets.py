"""The DDP step the rehearsal traces all-reduces the buckets of DDP's later iterations, not its first's one bucket."""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from raybench.planning.plan import plan
from raybench.rehearse import fake_world, trace
from raybench.runtime.strategies import RankContext
from raybench.spec.presets import PRESETS
from raybench.spec.load import parse_sweep

# Several of DDP's 25 MiB buckets: each MLP weight 4 MiB of fp32 gradient, each block about 14.5 MiB.
SHAPE = {**PRESETS["tiny"].hf_config_kwargs(), "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6}


def _real_buckets_after_two_steps(tmp_path) -> list[int]:
    """Bytes of each bucket a real DDP (one gloo rank) all-reduces from its second iteration on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM(LlamaConfig(**SHAPE)))
        tokens = torch.randint(0, SHAPE["vocab_size"], (1, 16))
        for _ in range(2):  # the second forward rebuilds the buckets in the order the first backward made them
            ddp(input_ids=tokens, labels=tokens).loss.backward()
        return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    finally:
        dist.destroy_process_group()


def test_the_trace_all_reduces_ddps_steady_state_buckets(tmp_path):
    """DDP's first iteration all-reduces every gradient at once after backward; from the second on, buckets of at
    most 25 MiB as backward makes them, beside its compute. The trace runs one step: it must see the later
    buckets (as many calls, of the same sizes), or every DDP step is priced with its whole all-reduce exposed."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SHAPE}))
    save_file({"unused": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # a model directory has weights
    spec = parse_sweep({"name": "ddp-buckets", "model": {"path": str(tmp_path)},
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 16, "micro_batch": 1,
                                  "precision": "fp32", "strategy": "ddp"},
                        "resources": {"workers": 2}})
    (trial,) = plan(spec)
    fake_world.init_fake_world(0, trial.world_size)
    try:
        step = trace.trace_step(trial.config, trial.shape, RankContext(0, trial.world_size, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    (_, backward), _optimizer = step.timeline
    traced = [nbytes for kind, name, nbytes, *_ in backward if kind == "comm" and "allreduce" in name]
    real = _real_buckets_after_two_steps(tmp_path)
    assert len(real) > 3  # the shape makes several buckets
    assert sum(traced) == sum(real) == step.comm_bytes["allreduce"]
    # In the order backward issues them; the trace takes backward's order to be the reverse of the parameters'
    # definition, so a norm's weight (2 KiB of fp32 here) may sit in the next bucket: two do on this shape.
    assert len(traced) == len(real)
    for ours, theirs in zip(traced, real):
        assert abs(ours - theirs) <= 2 * SHAPE["hidden_size"] * 4
