"""Security defaults: no secret in a row, safetensors only, no remote code, private store files (a real trial's
row and the embedded Ray's token auth: tests/integration/test_security_runs.py)."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch

from raybench.results import store
from raybench.runtime.fingerprint import captured_env
from raybench.spec.load import check_model_dir
from raybench.spec.sweep_spec import ModelSpec
from secret_values import SAFE, SECRETS


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
