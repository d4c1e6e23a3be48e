"""Plain torchrun on this machine, no Ray: the debugging path and the fallback where Ray is absent."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from raybench.trial import one_line_message


def execute(payload: dict) -> dict:
    workers = payload["config"]["resources"]["workers"]
    with tempfile.TemporaryDirectory(prefix="raybench-trial-") as tmp:
        payload_path, result_path = Path(tmp, "payload.json"), Path(tmp, "result.json")
        payload_path.write_text(json.dumps(payload))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
               "-m", "raybench.worker", str(payload_path), str(result_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not result_path.exists():
            tail = "\n".join(proc.stderr.splitlines()[-40:])
            raise RuntimeError(f"torchrun exited {proc.returncode}: {one_line_message(tail)}\n{tail}")
        return json.loads(result_path.read_text())
