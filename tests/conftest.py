"""Shared fixtures: tiny models, tokenizers and data made on the spot (nothing is ever downloaded)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests import file_seconds

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


def make_model_dir(directory: Path, vocab_size: int = 128, layers: int = 2) -> Path:
    """A 2-layer (or `layers`) Llama saved with safetensors, plus a tokenizer, in one Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    make_tokenizer(directory)
    return directory


def pytest_collection_modifyitems(config, items) -> None:
    """The heaviest test files first (their measured seconds, tests/file_seconds.json), each file's tests in their
    own order: with `-n 2 --dist loadfile --no-loadscope-reorder` the two workers take files in this order, so the
    run does not end on one long file while the other worker waits."""
    seconds = file_seconds.load()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


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


def assert_plan_refuses(sweep: Path, field: str, message: str, store: Path, err_of) -> None:
    """`raybench plan` exits 2 naming the field and why, with no traceback and no store written; err_of() returns
    the captured standard error."""
    from raybench.cli import main as cli

    assert cli.main(["plan", str(sweep), "--store", str(store)]) == 2
    err = err_of()
    assert field in err and message in err and "Traceback" not in err
    assert not store.exists()


# A chat template in the shape of real ones: each turn opened and closed by special tokens, and a generation prompt
# that opens the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant :{% endif %}")


def chat_records(n: int = 16) -> list[dict]:
    """Conversations of one or two exchanges, of varied lengths (words of the tiny tokenizer's vocabulary)."""
    def words(i: int, k: int) -> str:
        return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(k))

    records = []
    for i in range(n):
        turns = [{"role": "user", "content": words(i, 3 + i % 5)},
                 {"role": "assistant", "content": words(i + 1, 2 + (i * 3) % 7)}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": words(i + 2, 4)}, {"role": "assistant", "content": words(i, 5)}]
        records.append({"messages": turns})
    return records


def make_chat_tokenizer(directory: Path) -> Path:
    """The tiny tokenizer with a chat template."""
    from transformers import AutoTokenizer

    make_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in chat_records()))
    return path


@pytest.fixture(scope="session")
def chat_tokens(chat_file, chat_tokenizer) -> list[tuple[list[int], list[int]]]:
    """Each conversation of chat_file as token ids and assistant flags, counted without raybench: the template's
    pieces tokenized one by one (the tiny tokenizer splits on whitespace, so pieces tokenize as in the whole)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    out = []
    for line in chat_file.read_text().splitlines():
        ids, mask = [], []
        for message in json.loads(line)["messages"]:
            opening = tok(f"<s> {message['role']} :", add_special_tokens=False)["input_ids"]
            body = tok(f"{message['content']} </s>", add_special_tokens=False)["input_ids"]
            ids += opening + body
            mask += [0] * len(opening) + [int(message["role"] == "assistant")] * len(body)
        out.append((ids, mask))
    return out


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT raising KeyboardInterrupt in this test process, and at its default in the processes it starts, as in
    a terminal's shell: a library that an earlier test of this process ran may have left it ignored, which a child
    inherits through exec."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
