"""What a sweep's rehearsals share (rehearse_trials keeps one `traces` cache for the whole sweep): each shared
piece keyed by exactly what it depends on, and a point rehearsed among many equal to the point rehearsed alone."""

from __future__ import annotations

import dataclasses

import pytest

from raybench.planning.plan import config_id, plan
from raybench.rehearse import policy, rehearsal
from raybench.rehearse.fitted import SHIPPED_CALIBRATION
from raybench.rehearse.trace import StepTrace
from raybench.spec.load import parse_sweep

GPU = "H100 SXM"


def trials(axes: dict, preset: str = "tiny", **train) -> list:
    spec = parse_sweep({"name": "reuse", "model": {"preset": preset},
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 256, "micro_batch": 2, "precision": "bf16",
                                  "strategy": "fsdp2", **train},
                        "resources": {"workers": 2, "gpus_per_worker": 1}, "estimate": {"gpu": GPU}, "axes": axes})
    return plan(spec)


def test_one_block_s_operators_do_not_depend_on_the_world_or_the_micro_batch_count():
    points = trials({"resources.workers": [2, 8, 64], "train.grad_accum": [1, 4], "train.ac_ratio": ["0", "1"]})
    keys = {rehearsal.block_ops_key(t.config, GPU, SHIPPED_CALIBRATION) for t in points}
    assert len(keys) == 1
    # What the block runs does change them: its micro-batch, its sequence, its model.
    for changed in (trials({}, micro_batch=4), trials({}, seq_len=512), trials({}, preset="llama-3.2-1b")):
        assert rehearsal.block_ops_key(changed[0].config, GPU, SHIPPED_CALIBRATION) not in keys
    assert rehearsal.block_ops_key(points[0].config, "H200", SHIPPED_CALIBRATION) not in keys


def test_one_block_s_operators_from_a_one_block_model_are_the_whole_model_s_first_block_s():
    (t,) = trials({}, ac_ratio="1")
    assert t.shape.num_hidden_layers > 1
    one = policy.block_ops(t.config, t.shape, GPU)
    assert one == policy.block_ops(t.config, t.shape, GPU, layers=None)
    assert one["func_names"]


def test_a_ddp_step_is_traced_once_for_every_world_of_two_ranks_or_more():
    ddp = trials({"resources.workers": [1, 2, 8, 64]}, strategy="ddp", ac_ratio="1/2", grad_accum=4)
    keys = [config_id(rehearsal.step_config(t.config)) for t in ddp]
    assert keys[1] == keys[2] == keys[3] != keys[0]
    fsdp2 = trials({"resources.workers": [2, 8]})
    assert len({config_id(rehearsal.step_config(t.config)) for t in fsdp2}) == 2  # FSDP2 shards by the world
    # What makes it exact: the traced steps at 2 and at 64 ranks, every field (memory, collectives, timeline).
    steps = []
    for t in (ddp[1], ddp[3]):
        traces: dict = {}
        rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
        (step,) = {id(trace): trace for trace in traces.values() if isinstance(trace, StepTrace)}.values()
        steps.append(dataclasses.asdict(step))
    assert steps[0] == steps[1]


@pytest.mark.slow  # 12-97 s on the shared 2 cores, by their load; the tests above cover each key
def test_points_rehearsed_in_a_sweep_are_the_points_rehearsed_alone():
    """Points that share one block's operators (world sizes, accumulation counts) or their whole step (DDP's
    world sizes) rehearsed through one cache,
    field by field against each rehearsed with a cache of its own. (Compiled twins share their whole trace; a
    compiled point costs inductor's compile, too slow here: tests/unit/test_rehearse.py covers compile.)"""
    points = trials({"resources.workers": [2, 8], "train.grad_accum": [1, 4]}, ac_ratio="1")
    points += trials({"resources.workers": [2, 8]}, strategy="ddp")
    shared: dict = {}
    in_sweep = [rehearsal.rehearse(t.config, t.shape, GPU, traces=shared).as_dict() for t in points]
    alone = [rehearsal.rehearse(t.config, t.shape, GPU, traces={}).as_dict() for t in points]
    assert any(row["block_ops"] for row in alone)
    for one, other in zip(in_sweep, alone):
        one.pop("trace_s"), other.pop("trace_s")  # seconds spent: 0 where a trace was reused
        assert one == other
