"""warm_up.warm_up: a compiled trial's warm-up compiles its miniature (so the compiler's first use in a process is
not in a fresh process's training peak; docs/results/warm-fidelity-2026-11-26.md) and leaves no compiled graph
behind for the trial's own shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo import convert_frame

from raybench.planning.plan import plan
from raybench.rehearse.fake_world import init_fake_world
from raybench.runtime import build, warm_up
from raybench.runtime.strategies import RankContext
from raybench.runtime.techniques import compile
from raybench.spec.load import parse_sweep


@pytest.fixture
def one_rank():
    init_fake_world(0, 1)  # the strategy's collectives on a 1-rank group; the step itself runs for real
    yield RankContext(0, 1, 0, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_trials_warm_up_compiles_its_miniature_then_drops_it(one_rank, compiled):
    spec = parse_sweep({"name": "warm-up", "model": {"preset": "tiny"},
                        "train": {"strategy": "fsdp2", "steps": 2, "warmup_steps": 1, "seq_len": 32,
                                  "precision": "fp32", "compile": compiled}})
    (trial,) = plan(spec)
    torch.compiler.reset()
    before = compile.dynamo_counts()
    warm_up.warm_up(trial.payload, one_rank, trial.shape, build.build_and_wrap)
    graphs = compile.compiled_since(before)["compile_graphs"]
    assert graphs > 0 if compiled else graphs == 0
    assert not convert_frame.input_codes.seen  # reset: the trial compiles its own shapes from a clean state
