"""Security defaults: no secret in a row, safetensors only, no remote code, private store files, embedded Ray
with token auth."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch

from raybench.cli import main as cli
from raybench.results import store
from raybench.runtime.fingerprint import captured_env
from raybench.spec.load import check_model_dir
from raybench.spec.sweep_spec import ModelSpec

SECRETS = {"NCCL_IB_TOKEN": "tok-123", "AWS_SECRET_ACCESS_KEY": "aws-456", "HF_TOKEN": "hf_789",
           "CUDA_API_KEY": "cuda-000", "TORCH_PASSWORD": "pw-111", "RAY_AUTH_TOKEN": "ray-222",
           "NCCL_CREDENTIALS": "cred-333"}
SAFE = {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "4"}


def test_env_capture_redacts_secrets_and_keeps_the_allow_list():
    env = captured_env({**SECRETS, **SAFE, "HOME": "/root", "PATH": "/bin", "AWS_REGION": "eu"})
    assert env == SAFE
    assert not set(SECRETS.values()) & set(env.values())


def test_failed_trial_detail_keeps_the_traceback_and_drops_secret_values(tmp_path, monkeypatch):
    from raybench.drivers.trial import ERROR_DETAIL_CHARS, run_trial
    from raybench.planning.plan import plan
    from raybench.spec.load import parse_sweep

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # every embedded run sets it: a setting, whose value is no secret

    def failing_execute(payload):
        try:
            raise ValueError(f"hub refused token {SECRETS['HF_TOKEN']}")
        except ValueError as err:  # a nested cause, the way executors re-raise what a rank said
            raise RuntimeError("rank 0 failed:\nTraceback (most recent call last):\n" + "frame line\n" * 2000
                               + f"ValueError: {err}") from err

    (trial,) = plan(parse_sweep({"name": "s", "model": {"preset": "tiny"}}))
    row = run_trial(trial.payload, "s", str(tmp_path), "test", failing_execute)
    assert row["status"] == "error" and "hub refused token" in row["message"]
    assert "HF_TOKEN redacted" in row["message"] and "HF_TOKEN redacted" in row["error_detail"]
    assert row["error_detail"].endswith("token <HF_TOKEN redacted>") and len(row["error_detail"]) <= ERROR_DETAIL_CHARS
    stored = json.dumps(store.read_table(tmp_path).to_pylist(), default=str)  # every column, decompressed
    assert "frame line" in stored and not any(v in stored for v in SECRETS.values())


@pytest.mark.integration
def test_secret_in_environment_never_reaches_a_stored_row(tmp_path, monkeypatch):
    # A real trial (torchrun, no Ray) with secrets in the launching environment: none is written anywhere.
    for k, v in {**SECRETS, **SAFE}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: secrets\nmodel: {{preset: tiny}}\nstore: {tmp_path / 'store'}\n"
                     "train: {steps: 3, warmup_steps: 1, seq_len: 32, precision: fp32}\nresources: {workers: 1}\n")
    assert cli.main(["trial", str(sweep), "0"]) == 0
    row = store.read_results(tmp_path / "store").iloc[0]
    assert json.loads(row.env_json)["NCCL_DEBUG"] == "INFO"  # the allow-list works in a real row ...
    blob = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
    for value in SECRETS.values():  # ... and no secret value is in any stored byte
        assert value.encode() not in blob


def test_store_files_not_writable_by_others(tmp_path):
    old = os.umask(0)  # even a permissive umask must not make results writable by others
    try:
        path = store.write_row(tmp_path, {"sweep": "perm", "trial_id": "t-r0", "status": "ok"})
    finally:
        os.umask(old)
    for p in (path, path.parent):
        mode = stat.S_IMODE(p.stat().st_mode)
        assert not mode & (stat.S_IWGRP | stat.S_IWOTH), oct(mode)


def _pickle_model_dir(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    # transformers 5 always saves safetensors: write the pickle checkpoint the old way.
    directory.mkdir()
    config.save_pretrained(directory)
    torch.save(LlamaForCausalLM(config).state_dict(), directory / "pytorch_model.bin")
    return directory


def test_pickle_weights_refused_unless_allowed_with_a_warning(tmp_path, caplog):
    from raybench.runtime.build import build_model

    directory = _pickle_model_dir(tmp_path / "m")
    assert not list(directory.glob("*.safetensors"))
    refused = check_model_dir(str(directory), allow_pickle=False)
    assert refused and "allow_pickle" in refused[0].message
    with pytest.raises(Exception, match="allow_pickle"):
        build_model(ModelSpec(path=str(directory)), torch.device("cpu"), 0)[0]
    with caplog.at_level(logging.WARNING):
        model = build_model(ModelSpec(path=str(directory), allow_pickle=True), torch.device("cpu"), 0)[0]
    assert model is not None and "arbitrary code" in caplog.text


def test_remote_code_is_off_by_default():
    assert ModelSpec(preset="tiny").trust_remote_code is False
    assert ModelSpec(preset="tiny").allow_pickle is False


@pytest.mark.integration
def test_secret_embedded_ray_uses_token_auth(tmp_path):
    # A client without the run's token is refused by the embedded Ray; one with it gets in.
    script = """
import os, subprocess, sys
for k in [k for k in os.environ if k.startswith("RAY_")]:
    del os.environ[k]
from raybench.drivers.ray_cluster import ray_cluster
with ray_cluster(None):
    import ray  # raybench sets the auth mode before Ray is first imported
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) >= 32
    address = ray.get_runtime_context().gcs_address
    probe = "import ray; ray.init(address=%r, logging_level='ERROR'); print('JOINED')" % address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Two connection attempts, not Ray's default twenty (~1 s each): a refused token is refused on the first.
    outsider = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_AUTH_MODE": "token",
                              "RAY_AUTH_TOKEN": "0" * 64, "RAY_gcs_server_port_wait_time_s": "2"},
                              capture_output=True, text=True, timeout=120)
    insider = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_AUTH_MODE": "token",
                             "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]}, capture_output=True, text=True,
                             timeout=120)
    print("OUTSIDER", outsider.returncode, "JOINED" in outsider.stdout, "token-auth" in outsider.stderr)
    print("INSIDER", insider.returncode, "JOINED" in insider.stdout)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert "OUTSIDER" in proc.stdout, proc.stderr[-3000:]
    assert "OUTSIDER 1 False True" in proc.stdout  # wrong token: refused, and Ray says it was the token
    assert "INSIDER 0 True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
