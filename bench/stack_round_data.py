"""The model directory and chat data of GPU round 2 (your own stack on CUDA: bench/sweeps/gpu-stack-*.yaml), written
on the machine that runs them from a preset and a word list: nothing is downloaded, and the same command writes the
same files anywhere (a 1B model directory is too large to carry to the GPU machine).

    python3 bench/stack_round_data.py DIR [--preset llama-3.2-1b] [--chats 20000] [--dtype bf16] [--device cuda]

DIR gets:
- chat.jsonl: `--chats` conversations of `raybench example-data`'s (raybench.cli.example_data.chat_records);
- chat-tokenizer/: example-data's word-level tokenizer with a chat template (its ids fit any preset's vocabulary);
- model/: the preset's architecture with random weights, built as raybench builds a preset (seed 0), in safetensors
  at `--dtype`, with the chat tokenizer beside it. Llama-3.2-1B ties its output head to its embeddings, as the
  real checkpoint does (tie_word_embeddings), so the file holds no lm_head weight.
The round writes the 1B in bf16 (as the real checkpoint ships), and its CPU twins the tiny preset in bf16 too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from raybench.cli.example_data import chat_records, chat_tokenizer
from raybench.runtime.build import build_model
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import ModelSpec

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def write_data(out: Path, chats: int) -> None:
    """chat.jsonl and chat-tokenizer/ in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in chat_records(chats)) + "\n")
    chat_tokenizer(out / "chat-tokenizer")


def write_model(directory: Path, preset: str, dtype: str, device: str) -> None:
    """The preset as raybench builds it (fp32, seed 0), saved in safetensors at `dtype`."""
    model, _ = build_model(ModelSpec(preset=preset), torch.device(device), seed=0)
    model.to(DTYPES[dtype]).save_pretrained(directory, safe_serialization=True)


def write(out: Path, preset: str, dtype: str, device: str, chats: int) -> None:
    write_data(out, chats)
    write_model(out / "model", preset, dtype, device)
    for path in (out / "chat-tokenizer").iterdir():  # the model's own tokenizer: the chat one
        shutil.copy(path, out / "model" / path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    parser.add_argument("--chats", type=int, default=20000, help="conversations in chat.jsonl")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the saved weights' dtype")
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (cuda: faster)")
    args = parser.parse_args()
    out, start = Path(args.dir), time.perf_counter()
    write(out, args.preset, args.dtype, args.device, args.chats)
    weights_gib = sum(p.stat().st_size for p in (out / "model").glob("*.safetensors")) / 2**30
    print(f"{out}: chat.jsonl ({args.chats} conversations), chat-tokenizer/, model/ ({args.preset}, {args.dtype}, "
          f"{weights_gib:.2f} GiB of safetensors) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
