"""Security defaults on real runs: a trial under torchrun with secrets in its environment writes none of them, and
the embedded Ray refuses a client without the run's token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raybench.cli import main as cli
from raybench.results import store
from secret_values import SAFE, SECRETS

pytestmark = pytest.mark.integration


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
