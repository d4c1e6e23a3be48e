"""One real 2-rank trial: phases reconcile with the step, cost is projected, the all-reduce probe is cached,
and secrets in the environment leave no trace in the store."""

from __future__ import annotations

import json

import pytest

from raybench.drivers import executors
from raybench.drivers.trial import run_trial
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

pytestmark = pytest.mark.integration
SECRETS = {"HF_TOKEN": "hf_s3cr3tvalue111", "WANDB_API_KEY": "wandb-s3cr3t-222", "TORCH_FAKE_API_KEY": "s3cr3t-333"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("measure")
    spec = parse_sweep({
        "name": "measure", "model": {"preset": "tiny"},
        "train": {"steps": 8, "warmup_steps": 2, "seq_len": 64, "micro_batch": 2, "grad_accum": 2,
                  "precision": "fp32", "strategy": "fsdp2"},
        "resources": {"workers": 2}, "projection": {"dataset_tokens": 1.0e6, "epochs": 2},
        "axes": {"setup": [{"train.strategy": "fsdp2", "train.ac_ratio": "1"},
                           {"train.strategy": "ddp", "train.ac_ratio": "0", "train.profile_steps": 2}]},
    })
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SECRETS.items():
            mp.setenv(key, value)
        mp.setenv("NCCL_DEBUG", "WARN")
        rows = [run_trial(t.payload, "measure", str(tmp), "torchrun", executors.get("torchrun"))
                for t in plan(spec)]
    return tmp, rows


def test_phases_reconcile_with_step_time(measured):
    _, rows = measured
    for row in rows:
        assert row["status"] == "ok", row["message"]
        for phase in ("data", "forward", "backward", "optimizer"):
            assert row[f"phase_{phase}_p50_s"] >= 0 and row[f"phase_{phase}_p90_s"] >= row[f"phase_{phase}_p50_s"]
        assert row["phase_backward_mean_s"] > row["phase_data_mean_s"]
        assert 0.95 <= row["phase_sum_over_step"] <= 1.05


def test_exposed_communication_measured_for_ddp(measured):
    _, (fsdp2, ddp) = measured
    assert fsdp2["comm_exposed_p50_s"] is None and fsdp2["comm_exposed_frac"] is None
    assert ddp["comm_exposed_p50_s"] >= 0
    assert ddp["comm_exposed_frac"] == pytest.approx(ddp["comm_exposed_p50_s"] / ddp["step_time_p50_s"])
    assert ddp["comm_exposed_p50_s"] <= ddp["phase_backward_p90_s"]  # a part of the backward, never more


def test_projection_setup_times_and_null_mfu(measured):
    _, rows = measured
    row = rows[0]
    steps = -(-2_000_000 // (2 * 64 * 2 * 2))  # synthetic tokens: no padding, every processed token is real
    assert row["projected_steps"] == steps
    assert row["projected_hours"] == pytest.approx(2_000_000 / row["nonpad_tok_per_s"] / 3600)
    assert row["projected_device_hours"] == pytest.approx(row["projected_hours"] * 2)
    assert row["mfu"] is None and row["flops_per_token"] > 0
    assert row["first_step_s"] > 0 and row["time_to_first_step_s"] >= row["first_step_s"]
    assert row["model_build_s"] > 0 and row["wrap_s"] > 0
    assert row["cpu_util_pct"] is None or row["cpu_util_pct"] >= 0
    assert row["data_fs_type"]
    assert len(row["peak_rss_gib_by_rank"]) == 2 and max(row["peak_rss_gib_by_rank"]) == row["peak_rss_gib"]
    assert row["peak_alloc_gib_by_rank"] is None  # CPU: no CUDA allocator
    assert row["nccl_transport_check"] == "not checked (gloo)" and row["nccl_transports_json"] is None


def test_allreduce_probe_measured_once_and_cached(measured):
    tmp, rows = measured
    first, second = (json.loads(r["allreduce_busbw_json"]) for r in rows)
    assert set(first) == {"1", "4", "16"} and all(v > 0 for v in first.values())  # CPU: up to 16 MiB
    assert first == second  # the second trial read the cache instead of measuring again
    assert len(list((tmp / "_cache").glob("busbw-*.json"))) == 1


def test_secrets_leave_no_trace_in_store(measured):
    tmp, rows = measured
    env = json.loads(rows[0]["env_json"])
    assert env.get("NCCL_DEBUG") == "WARN" and "TORCH_FAKE_API_KEY" not in env
    blobs = b"".join(p.read_bytes() for p in tmp.rglob("*") if p.is_file())
    for value in SECRETS.values():
        assert value.encode() not in blobs
    assert len(store.read_results(tmp)) == 2


def test_the_collectives_bytes_are_what_the_strategy_moves(measured):
    """DDP all-reduces every gradient once a step (accumulation syncs on the last micro-batch only): fp32 gradients,
    4 bytes each, times nccl-tests' 2(n-1)/n, which is 1 on 2 ranks. Before that step's forward it broadcasts the
    model's buffers (the tiny Llama's two rotary tables of 16 floats), and once, after its first step, a few
    bytes to rebuild its buckets. Read from torch's flight recorder, over the 8 steps of the loop."""
    _, (fsdp2, ddp) = measured
    grads, buffers = ddp["params_trainable"] * 4, 2 * 16 * 4
    assert grads + buffers <= ddp["comm_bus_gb_per_step"] * 1e9 <= grads + buffers + 1024 / 8, ddp["comm_bus_gb_per_step"]
    assert ddp["comm_busbw_over_step_gbps"] == pytest.approx(ddp["comm_bus_gb_per_step"] / ddp["step_time_p50_s"])
    # Profiled: the bandwidth over the collectives' own time, against the probe; no table figure for CPUs.
    assert ddp["comm_busbw_gbps"] == pytest.approx(ddp["comm_bus_gb_per_step"] / ddp["profile_comm_s"])
    assert ddp["comm_busbw_of_probe"] == pytest.approx(ddp["comm_busbw_gbps"] / ddp["allreduce_busbw_gbps"])
    assert ddp["comm_busbw_of_link"] is None
    # FSDP2 gathers the weights again for each micro-batch's forward and backward: more bytes than DDP's one
    # all-reduce; not profiled, so no achieved bandwidth.
    assert fsdp2["comm_bus_gb_per_step"] > ddp["comm_bus_gb_per_step"] and fsdp2["comm_busbw_gbps"] is None
