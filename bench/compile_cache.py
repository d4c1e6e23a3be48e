"""What inductor's cache saves on this machine: the first compiled forward and backward of the tiny test Llama
(2 layers, tests/conftest.py's shape) in a fresh process, with an empty TORCHINDUCTOR_CACHE_DIR, then with the cache
that run filled, then the same model under Hugging Face's gradient checkpointing (other graphs) on that cache.

    .venv/bin/python bench/compile_cache.py

Each case runs in a process of its own (inductor also caches in memory). Prints one line per case: the seconds of
the first step (compile included) and of the second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CASE = """
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=512))
if sys.argv[1] == "checkpointed":
    model.gradient_checkpointing_enable()
compiled = torch.compile(model)
ids = torch.randint(0, 128, (2, 64))
times = []
for _ in range(2):
    start = time.perf_counter()
    compiled(input_ids=ids, labels=ids).loss.backward()
    times.append(time.perf_counter() - start)
print(json.dumps({"first_step_s": round(times[0], 2), "second_step_s": round(times[1], 3)}))
"""


def run(case: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", CASE, case], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        for label, case in (("empty cache", "plain"), ("the cache it filled", "plain"),
                            ("checkpointed twin, that cache", "checkpointed")):
            print(f"{label}: {json.dumps(run(case, cache))}", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        print(f"checkpointed twin, empty cache: {json.dumps(run('checkpointed', cache))}")


if __name__ == "__main__":
    main()
