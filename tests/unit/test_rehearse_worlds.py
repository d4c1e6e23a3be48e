"""An FSDP2 or TP x FSDP2 step shared across world sizes (rehearse/worlds.py), checked against tracing that world
size itself: every field of the rehearsal equal (bytes exactly, times to float rounding); where FSDP2 pads, the
world size is traced and the row says why. The line's two ends come from one trace: the step traced, and the step
at twice its FSDP2 group size with its part on the shards scaled (rehearse/shards.py), itself checked against
that world size's own trace."""

from __future__ import annotations

import math

import pytest

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, worlds
from raybench.spec.load import parse_sweep

GPU = "H100 SXM"
REL_TOL = 1e-9  # float sums of the same operators' costs in another order


def trial(model_dir, workers: int, **train):
    spec = parse_sweep({"name": "worlds", "model": {"path": str(model_dir)},
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 512, "micro_batch": 2, "precision": "bf16",
                                  **train},
                        "resources": {"workers": workers, "gpus_per_worker": 1}, "estimate": {"gpu": GPU}})
    (planned,) = plan(spec)
    return planned


def differences(shared, alone, path: str = "") -> list[str]:
    """Where two rehearsals' fields differ (nested), floats beyond REL_TOL; empty where they agree."""
    if isinstance(shared, dict) and isinstance(alone, dict):
        if shared.keys() != alone.keys():
            return [f"{path}: keys {sorted(shared.keys() ^ alone.keys(), key=str)}"]
        return [d for key in shared for d in differences(shared[key], alone[key], f"{path}.{key}")]
    if isinstance(shared, (list, tuple)) and isinstance(alone, (list, tuple)):
        if len(shared) != len(alone):
            return [f"{path}: {len(shared)} against {len(alone)} items"]
        return [d for i, (a, b) in enumerate(zip(shared, alone)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(shared, float) and isinstance(alone, float):
        return [] if math.isclose(shared, alone, rel_tol=REL_TOL, abs_tol=1e-300) else [f"{path}: {shared} {alone}"]
    return [] if shared == alone else [f"{path}: {shared!r} {alone!r}"]


# (the world traced and the one its shards are scaled to, the world shared from them, a world whose shards FSDP2
# pads, the trial). The tiny model's key and value projections have 32 rows: 64 FSDP2 ranks pad them, and so do 32
# under TP 2 (16 rows a TP rank).
CASES = {
    "fsdp2 accumulating": ((2, 4), 16, 64, {"strategy": "fsdp2", "grad_accum": 2}),
    "tp_fsdp2 sAC 1/2": ((4, 8), 16, 64, {"strategy": "tp_fsdp2", "tp_size": 2, "ac_ratio": "1/2"}),
}


def _fields(rehearsed) -> dict:
    return {name: value for name, value in rehearsed.as_dict().items() if name not in ("notes", "trace_s")}


@pytest.mark.parametrize("case", CASES)
def test_a_world_size_on_the_line_of_two_traced_ones_is_its_own_trace(case, model_dir):
    (traced_world, split_world), shared_world, padded_world, train = CASES[case]
    traces = {}
    t = trial(model_dir, traced_world, **train)
    first = rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
    assert not any("shared to" in note or "scaled to" in note for note in first.notes), first.notes
    notes = {split_world: f"traced at {traced_world} ranks, its part on the shards scaled to {split_world}",
             shared_world: f"traced at {traced_world} ranks and split, shared to {shared_world}"}
    for world, note in notes.items():
        t = trial(model_dir, world, **train)
        shared = rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
        alone = rehearsal.rehearse(t.config, t.shape, GPU, traces={}, share_worlds=False)
        assert any(n.startswith(note) for n in shared.notes), shared.notes
        assert [n for n in shared.notes if not n.startswith(note)] == alone.notes
        assert differences(_fields(shared), _fields(alone)) == [], world
    # Padding: traced, and the row says why it was not shared.
    t = trial(model_dir, padded_world, **train)
    padded = rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
    assert any(n.startswith("world size not shared: FSDP2 pads dimensions") for n in padded.notes), padded.notes
    assert not any("shared to" in n for n in padded.notes)


def events(*rows: tuple[str, list[int]]) -> worlds.MemoryEvents:
    recorded = worlds.MemoryEvents(("parameters", "activations"), initial_bytes=(0, 0))
    for place, category_bytes in rows:
        recorded.record(place, category_bytes)
    return recorded


class _Step:
    """The fields of a StepTrace that worlds.share reads, for a step of three operators."""

    def __init__(self, dp: int):
        # Operator 1 holds shards and little else, operator 2 a fixed 1 KiB and fewer shards: with more ranks
        # the peak moves from the first operator to the second. Operator 3 holds less than operator 2 at every
        # world size.
        self.memory_events = events(("0:forward:0", [8 * 1024 // dp, 0]),
                                    ("0:forward:0", [2 * 1024 // dp, 1024]),
                                    ("0:forward:0", [1024 // dp, 512]))
        self.sharding = worlds.Sharding(dp, (1024,))
        self.comm_calls, self.comm_bytes, self.op_s, self.launches = {}, {}, {}, 3
        self.grad_accum = self.traced_micro_batches = 1
        self.timeline, self.place_gib, self.overlapped_comm = [], {"0:forward:0": {}}, ()


def test_the_peak_is_found_again_where_it_moved():
    """The line gives every operator's memory at the new world size; the peak is the highest of those, not the
    traced peak scaled. Of the operators, those that can be the highest at some world size are kept."""
    traced = {2: _Step(2), 4: _Step(4)}
    worlds.compact(traced)
    assert list(traced[2].memory_events.category_bytes) == [4096, 0, 1024, 1024]  # the third dropped
    at = worlds._memory_at(traced[2].memory_events, traced[4].memory_events, worlds._Line(2, 4, 16))
    assert list(at.category_bytes) == [512, 0, 128, 1024]
    peak, places, _ = worlds.replay(at)
    assert peak == {"parameters": 128 / 2**30, "activations": 1024 / 2**30}
    assert places == {"0:forward:0": peak}
    at_two = worlds._memory_at(traced[2].memory_events, traced[4].memory_events, worlds._Line(2, 4, 2))
    assert worlds.replay(at_two)[0] == {"parameters": 4096 / 2**30, "activations": 0.0}


def test_a_line_that_gives_part_of_a_byte_is_not_used():
    with pytest.raises(worlds._NotWhole):
        worlds._Line(2, 4, 8).bytes(3, 2, "parameters")  # 3 bytes on 2 ranks, 2 on 4: 1.5 on 8
    assert worlds.share(3, {2: _Step(2), 4: _Step(4)}) == "FSDP2 pads dimensions [1024] over 3 ranks"


def test_steps_that_run_differently_are_not_a_line():
    """Two traced world sizes whose steps differ beyond their sizes (here a collective called once more) say so,
    and the third world size is traced."""
    other = _Step(4)
    other.comm_calls = {"all_gather_into_tensor": 1}
    assert worlds.share(16, {2: _Step(2), 4: other}) == (
        "the steps traced at 2 and 4 FSDP2 ranks differ in collectives' calls")
    assert worlds.share(16, {2: _Step(2)}) is None  # one world size traced: trace this one too


@pytest.mark.slow  # ~10 s: shallow models at three world sizes; the default cases above run the same _world_trace
def test_shallow_models_are_shared_across_world_sizes(tmp_path):
    """A deep model extrapolated from shallow ones (depth.py), each shallow one shared across world sizes: the
    rehearsal equals the one whose shallow models were traced at that world size."""
    from conftest import make_model_dir

    deep = make_model_dir(tmp_path / "deep", layers=8)
    train = {"strategy": "fsdp2", "ac_ratio": "1/2"}
    traces = {}
    for workers in (2, 4):
        t = trial(deep, workers, **train)
        rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
    t = trial(deep, 8, **train)
    shared = rehearsal.rehearse(t.config, t.shape, GPU, traces=traces)
    alone = rehearsal.rehearse(t.config, t.shape, GPU, traces={}, share_worlds=False)
    assert any("extrapolated to 8 blocks" in n for n in shared.notes), shared.notes
    assert any(n.startswith("traced at 2 ranks and split, shared to 8") for n in shared.notes), shared.notes
    fields = {name: value for name, value in shared.as_dict().items() if name not in ("notes", "trace_s")}
    expected = {name: value for name, value in alone.as_dict().items() if name not in ("notes", "trace_s")}
    assert differences(fields, expected) == []


def test_a_reduce_scatter_the_ledger_does_not_recognise_leaves_the_second_end_to_a_trace(model_dir, monkeypatch):
    """Another torch's FSDP2 might reduce-scatter through another operator: the ledger would not count the gradient
    shards, so no second end is built from the trace, and the next world size is traced as before."""
    from raybench.rehearse import shards

    t = trial(model_dir, 2, strategy="fsdp2")
    built = rehearsal._trace(t.config, t.shape, 0, GPU, rehearsal.SHIPPED_CALIBRATION, record_events=True,
                             second_dp=4)
    assert built.second is not None and built.second.sharding.dp == 4
    monkeypatch.setattr(shards, "FSDP_REDUCE_SCATTER", object())
    unrecognised = rehearsal._trace(t.config, t.shape, 0, GPU, rehearsal.SHIPPED_CALIBRATION, record_events=True,
                                    second_dp=4)
    assert unrecognised.comm_calls["reduce_scatter_base"] > 0 and unrecognised.second is None
