"""RAYBENCH_CUDA_MEMORY_SNAPSHOT: what was live at a trial's GPU peak, from torch's allocator history. The
replay is checked on events in torch's snapshot format (CUDA runs them in tests/gpu/test_gpu_snapshot.py);
on CPU the request fails with a clear error, before anything is recorded."""

from __future__ import annotations

import pytest
import torch

from raybench.cli.main import main
from raybench.runtime import cuda_snapshot
from raybench.spec.schema import GIB

MODEL = "/site-packages/transformers/models/llama/modeling_llama.py"
STEP = "/work/raybench/runtime/strategies/__init__.py"


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def alloc(addr: int, gib: float, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def free(addr: int, gib: float) -> dict:
    return {"action": "free_completed", "addr": addr, "size": int(gib * GIB), "frames": []}


def test_the_peak_is_what_was_live_at_once_grouped_by_the_model_line():
    linear = frame("/site-packages/torch/nn/modules/linear.py", 134, "forward")
    events = [
        alloc(1, 4.0, frame(STEP, 90, "setup")),  # held throughout
        alloc(2, 2.0, linear, frame(MODEL, 210, "forward")),
        alloc(3, 2.0, linear, frame(MODEL, 210, "forward")),  # same model line: one group
        alloc(4, 1.0, frame(MODEL, 300, "forward")),  # the peak: 4 + 2 + 2 + 1
        free(4, 1.0),
        alloc(5, 0.5, frame(MODEL, 300, "forward")),  # 8.5 live
        free(2, 2.0), free(3, 2.0),
        alloc(6, 3.0, frame(STEP, 120, "backward")),  # 7.5 live
        {"action": "segment_alloc", "addr": 100, "size": GIB, "frames": []},  # cudaMalloc: no tensor
    ]
    peak = cuda_snapshot.live_at_peak(events)
    assert peak["peak_gib"] == pytest.approx(9.0) and peak["allocations"] == 4
    groups = {g["allocated_at"]: (g["gib"], g["allocations"]) for g in peak["groups"]}
    assert groups == {"transformers/models/llama/modeling_llama.py:210:forward": (4.0, 2),
                      "/work/raybench/runtime/strategies/__init__.py:90:setup": (4.0, 1),
                      "transformers/models/llama/modeling_llama.py:300:forward": (1.0, 1)}
    assert peak["other_gib"] == 0


def test_deepspeeds_own_line_names_what_it_allocates():
    """What DeepSpeed's engine and ZeRO optimizers allocate goes under their line, not under the torch call below
    it (round 8's offload snapshot: where the offloaded trials' GiB sit on the GPU)."""
    zero = frame("/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", 1234, "initialize_optimizer_states")
    adamw = frame("/site-packages/torch/optim/adamw.py", 80, "_init_group")
    events = [alloc(1, 2.0, adamw, zero, frame(STEP, 90, "setup"))]
    (group,) = cuda_snapshot.live_at_peak(events)["groups"]
    assert group["allocated_at"] == "deepspeed/runtime/zero/stage_1_and_2.py:1234:initialize_optimizer_states"


def test_the_training_window_leaves_out_a_higher_build_peak():
    """The peak file's peak is the row's peak_alloc_gib: CUDA's counter is reset after the build, so a build
    that peaked higher (a full-precision copy of the weights, say) is not it; what the build left live is."""
    events = [
        alloc(1, 2.0, frame(MODEL, 50, "__init__")),  # the weights: held throughout
        alloc(2, 6.0, frame(STEP, 40, "build")),  # the build's temporary: 8 live, the recording's peak
        free(2, 6.0),
        alloc(3, 1.0, frame(MODEL, 210, "forward")),  # the training window opens here, with 2 live
        alloc(4, 2.0, frame(MODEL, 300, "forward")),  # its peak: 2 + 1 + 2
        free(3, 1.0), free(4, 2.0),
    ]
    assert cuda_snapshot.live_at_peak(events)["peak_gib"] == pytest.approx(8.0)
    training = cuda_snapshot.live_at_peak(events, since=3)
    assert training["peak_gib"] == pytest.approx(5.0) and training["allocations"] == 3
    # A window that opens after the last event holds what was live then.
    assert cuda_snapshot.live_at_peak(events[:3], since=3)["peak_gib"] == pytest.approx(2.0)


def test_a_cpu_rank_refuses_the_request(tmp_path):
    with (pytest.raises(ValueError, match="RAYBENCH_CUDA_MEMORY_SNAPSHOT=.*needs a CUDA device.*unset"),
          cuda_snapshot.recording(tmp_path / "snap", torch.device("cpu"), "t-rank0")):
        pass
    assert not (tmp_path / "snap").exists()


def test_a_sweep_of_cpu_trials_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    """`raybench run` and `raybench trial` check the request against the planned trials: exit 2, no worker,
    nothing stored."""
    monkeypatch.setenv(cuda_snapshot.ENV, str(tmp_path / "snap"))
    sweep = tmp_path / "cpu.yaml"
    sweep.write_text("name: cpu\nmodel: {preset: tiny}\ntrain: {steps: 2, warmup_steps: 1, seq_len: 32}\n")
    store = tmp_path / "store"
    assert main(["run", str(sweep), "--store", str(store)]) == 2
    assert main(["trial", str(sweep), "0", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "RAYBENCH_CUDA_MEMORY_SNAPSHOT" in err and "run on CPU" in err and "gpus_per_worker" in err
    assert not store.exists() and not (tmp_path / "snap").exists()
