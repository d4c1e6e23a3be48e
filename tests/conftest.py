"""Shared fixtures: tiny models, tokenizers and data made on the spot (nothing is ever downloaded)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid "
         "gold under pale moonlight and every model learns tokens fast").split()


def alpaca_records(n: int = 64) -> list[dict]:
    return [
        {"instruction": " ".join(WORDS[i % 7: i % 7 + 6]), "input": " ".join(WORDS[i % 5: i % 5 + 3]) if i % 2 else "",
         "output": " ".join(WORDS[(i * 3) % 11: (i * 3) % 11 + 8])}
        for i in range(n)
    ]


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    corpus = [json.dumps(r) for r in alpaca_records()] + ["### Instruction Input Response :"]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def make_model_dir(directory: Path, vocab_size: int = 128) -> Path:
    """A 2-layer Llama saved with safetensors, plus a tokenizer, in one Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def alpaca_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "alpaca.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in alpaca_records()))
    return path


def write_sweep(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
