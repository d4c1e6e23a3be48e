"""A deep model's step extrapolated from shallow ones (rehearse/depth.py), checked against the full trace of the
same trial: memory by category, collectives, FLOPs and operator time agree; where the line does not hold, the
rehearsal traces the whole model and says why."""

from __future__ import annotations

from fractions import Fraction

import pytest

from raybench.planning.plan import plan
from raybench.rehearse import depth, rehearsal
from raybench.rehearse.trace import StepTrace
from raybench.spec.load import parse_sweep
from raybench.spec.sac import checkpointed_blocks
from conftest import make_model_dir

GPU = "H100 SXM"
LAYERS = 10
# The line and the full trace agree to the byte on time, FLOPs and collectives; on memory to within a few KiB
# that torch's tracker counts in the shallow models and not in the deep one (8 KiB on this model, where the peak
# is 19 MiB; 0.6 MiB of 221 GiB on a 72B model).
MEMORY_TOLERANCE_GIB = 64 / 2**20
CASES = {
    "fsdp2 no checkpointing": (2, {"strategy": "fsdp2", "ac_ratio": "0"}),
    "fsdp2 sAC 1/3": (2, {"strategy": "fsdp2", "ac_ratio": "1/3"}),
    # Top ends of five blocks (1/4: plain block 8 and checkpointed 5 are the highest below the top) and three.
    "fsdp2 sAC 1/4, 8 ranks": (8, {"strategy": "fsdp2", "ac_ratio": "1/4"}),
    "fsdp2 sAC 3/4, 8 ranks": (8, {"strategy": "fsdp2", "ac_ratio": "3/4"}),
    "fsdp2 op-level": (2, {"strategy": "fsdp2", "ac_ratio": "1", "ac_mode": "op"}),
    "tp sAC 1/2": (2, {"strategy": "tp", "tp_size": 2, "ac_ratio": "1/2"}),
    "tp_fsdp2 lora accumulating": (4, {"strategy": "tp_fsdp2", "tp_size": 2, "finetune": "lora", "ac_ratio": "3/4",
                                       "grad_accum": 2}),
    "ddp lora": (2, {"strategy": "ddp", "finetune": "lora", "ac_ratio": "1/4"}),
}


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("deep-llama"), layers=LAYERS)


def trial(model_dir, workers: int, **train):
    spec = parse_sweep({"name": "depth", "model": {"path": str(model_dir)},
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 512, "micro_batch": 2, "precision": "bf16",
                                  **train},
                        "resources": {"workers": workers, "gpus_per_worker": 1}, "estimate": {"gpu": GPU}})
    (planned,) = plan(spec)
    return planned


def test_memory_growing_across_one_kind_and_shrinking_across_the_other_is_extrapolated_block_by_block(deep_model):
    """At 64 tokens a checkpointed block keeps less (its input) than its gradient shard adds in backward, and a
    plain block frees more: memory grows down some blocks and shrinks down others, so the peak could be any
    block's. Each middle block's places are then extrapolated by position (checked on the check model's two
    middle blocks), and the peak is the full trace's."""
    t = trial(deep_model, 2, strategy="fsdp2", ac_ratio="1/3", seq_len=64)
    full = rehearsal.rehearse(t.config, t.shape, GPU, extrapolate_depth=False)
    deep = rehearsal.rehearse(t.config, t.shape, GPU)
    assert any("extrapolated to 10 blocks" in note for note in deep.notes), deep.notes
    assert deep.memory_gib == full.memory_gib


# LoRA's PEFT wrapping makes each trace several times slower, and 3/4 checks what 1/4 checks (an extended top
# end): those cases run with -m slow.
SLOW = {"tp_fsdp2 lora accumulating", "ddp lora", "fsdp2 sAC 3/4, 8 ranks"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW else case
                                  for case in CASES])
def test_the_extrapolated_step_is_the_full_trace(case, deep_model):
    workers, train = CASES[case]
    t = trial(deep_model, workers, **train)
    full = rehearsal.rehearse(t.config, t.shape, GPU, extrapolate_depth=False)
    traces = {}
    deep = rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
    assert full.method == deep.method == "traced", (full.notes, deep.notes)
    note = f"extrapolated to {LAYERS} blocks"
    assert any(note in n for n in deep.notes), deep.notes
    shallow_depths = {len(key[2]) for key in traces if key[0] == "shallow"}
    assert max(shallow_depths) < LAYERS  # the point: no trace of the whole model was run
    for category, gib in full.memory_gib.items():
        assert deep.memory_gib[category] == pytest.approx(gib, abs=MEMORY_TOLERANCE_GIB), category
    assert deep.resident_gib == pytest.approx(full.resident_gib, rel=1e-9)
    assert deep.comm_bytes == full.comm_bytes
    for name in ("flops", "roofline_s", "compute_s", "block_memory_bound_s", "exposed_comm_s", "step_time_s"):
        assert getattr(deep, name) == pytest.approx(getattr(full, name), rel=1e-9), name


def test_sac_ratios_share_their_shallow_models(deep_model):
    """sAC ratios whose deep models have the same ends share their shallow models: 1/5 and 1/3 of 10 blocks
    both checkpoint middle blocks only (2, 7 and 1, 4, 7), so two trials need four shallow traces, not eight."""
    traces = {}
    for ratio in ("1/5", "1/3"):
        t = trial(deep_model, 2, strategy="fsdp2", ac_ratio=ratio)
        assert any("extrapolated" in note for note in rehearsal.rehearse(t.config, t.shape, GPU, traces=traces).notes)
    assert len([key for key in traces if key[0] == "shallow"]) == 4


def shallow_trace(middle_gib: float, peak_place: str = "0:backward:outside", growth: float = 0.0) -> StepTrace:
    """A shallow StepTrace whose only memory is `middle_gib` of activations at `peak_place`, and whose backward
    grows memory by `growth` GiB from its block 1 (the highest middle block of a 4-block model) to block 0."""
    return StepTrace(memory_gib={}, resident_gib={}, comm_bytes={"all_gather": 1}, comm_calls={"all_gather": 1},
                     overlapped_comm=(), flops=1.0, roofline_s=1.0, compute_s=1.0, memory_s=0.0,
                     place_gib={peak_place: {"activations": middle_gib}},
                     backward_entry_gib={(0, 0): 1.0 + growth, **{(0, block): 1.0 for block in range(1, 6)}})


def test_a_line_the_check_model_breaks_is_not_extrapolated():
    kinds = (False,) * 12
    layouts = depth.shallow_layouts(kinds)
    assert set(layouts) == {"base", "plain", "check"}
    assert [len(layout) for layout in layouts.values()] == [3, 4, 5]
    line = {"base": shallow_trace(1.0), "plain": shallow_trace(2.0), "check": shallow_trace(3.0)}
    deep = depth.extrapolate(kinds, line)
    assert isinstance(deep, StepTrace) and deep.memory_gib == {"activations": pytest.approx(10.0)}
    bent = dict(line, check=shallow_trace(3.5))
    assert "0:backward:outside.activations is not linear" in depth.extrapolate(kinds, bent)


def test_memory_that_grows_across_middle_blocks_or_peaks_in_one_is_not_extrapolated():
    kinds = (False,) * 12
    line = {"base": shallow_trace(1.0), "plain": shallow_trace(2.0), "check": shallow_trace(3.0)}
    grows = dict(line, plain=shallow_trace(2.0, growth=0.25))
    assert "grows memory by 256.0 MiB" in depth.extrapolate(kinds, grows)
    peaks_in_middle = shallow_trace(3.0)
    peaks_in_middle.place_gib["0:backward:2"] = {"activations": 5.0}  # blocks 1 and 2 of 5 are the middle
    middle = dict(line, check=peaks_in_middle)
    assert "peaks in a middle block" in depth.extrapolate(kinds, middle)


def test_shallow_models_keep_the_deep_ends():
    """The top end reaches down to the highest block of each kind below the top block (here block 7, plain)."""
    kinds = (True, False, True, False, True, False, True, False, True, True)
    layouts = depth.shallow_layouts(kinds)
    assert layouts == {"base": (True, False, True, True), "plain": (True, False, False, True, True),
                       "checkpointed": (True, True, False, True, True),
                       "check": (True, False, True, False, True, True)}
    assert depth.shallow_layouts(kinds[:depth.MIN_LAYERS - 1]) is None


@pytest.mark.parametrize("ratio, top", [("0", 2), ("1", 2), ("1/4", 3), ("1/2", 3), ("3/4", 3), ("1/40", 21)])
def test_the_top_end_holds_the_highest_block_of_each_kind_below_the_top(ratio, top):
    """On 80 blocks: sAC 1/4 checkpoints block 77 under two plain ones, 3/4 blocks 77 and 79 around a plain 78;
    a middle block of a kind then sits below a block of its kind in the top end, never above it."""
    kinds = tuple(i in set(checkpointed_blocks(Fraction(ratio), 80)) for i in range(80))
    assert depth.ends(kinds) == (1, top)
    assert set(kinds[1:-top]) <= set(kinds[-top:-1])
