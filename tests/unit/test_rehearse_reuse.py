"""What a sweep's rehearsals share (rehearse_trials keeps one `traces` cache for the whole sweep): each shared
piece keyed by exactly what it depends on, and a point rehearsed among many equal to the point rehearsed alone."""

from __future__ import annotations

from raybench.planning.plan import plan
from raybench.rehearse import policy, rehearsal
from raybench.rehearse.fitted import SHIPPED_CALIBRATION
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
