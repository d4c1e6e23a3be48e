"""`raybench example-data DIR`: the tiny model, tokenizers and data the shipped CPU sweeps read, made here from a
word list (nothing is downloaded), so that every `sweeps/*cpu*.yaml` runs as shipped on a fresh clone once
`raybench example-data sweeps/example-data` has run (their paths are relative to the sweep file: README.md).

DIR gets:
- chat.jsonl: conversations of one or two exchanges ({"messages": [...]}), for chat-cpu and stack-hf-cpu;
- chat-tokenizer/: a word-level tokenizer of those words with a chat template;
- tiny-model/: a 2-layer Llama (hidden 64, 4 heads, 2 KV heads, MLP 128, vocab 128, untied head: the shape of
  sweeps/stacks/torchtune_tiny_lora.yaml) in safetensors, random weights, with the chat tokenizer;
- alpaca.json: {instruction, input, output} records, for stack-torchtune-cpu;
- text/: JSON lines of {"text": ...}, and text-tokenizer/: a byte-level BPE tokenizer of them (tokenizer.json, bos
  and eos in tokenizer_config.json), for stack-torchtitan-cpu;
- tokenizer.model: a SentencePiece model of the records' words, for stack-torchtune-cpu, trained by an interpreter
  that has sentencepiece (--sentencepiece-python, e.g. torchtune's environment; else this one, if it has it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from raybench.spec.errors import ConfigError, Problem

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid gold under pale "
         "moonlight and every model learns tokens fast when small batches train on short chats about weather "
         "rivers songs maps clocks gardens and trains").split()
# Each turn opened and closed by special tokens, and a generation prompt that opens the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant :{% endif %}")
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
MODEL_VOCAB = 128  # the tiny model's vocabulary: the chat tokenizer's must fit in it
CHATS, ALPACA_RECORDS, TEXTS = 200, 400, 300
# alpaca's prompt, whose words torchtune's tokenizer must know too.
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                 "the request. ### Instruction: ### Input: ### Response:")
_SENTENCEPIECE = """
import sentencepiece as spm, sys
spm.SentencePieceTrainer.train(input=sys.argv[1], model_prefix=sys.argv[2], vocab_size=128, model_type="bpe",
                               character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
"""


def _words(seed: int, count: int) -> str:
    return " ".join(WORDS[(seed * 7 + j * 3) % len(WORDS)] for j in range(count))


def chat_records(n: int = CHATS) -> list[dict]:
    """Conversations of one or two exchanges, 5 to 60 words each, some longer than the sweeps' seq_len."""
    records = []
    for i in range(n):
        turns = [{"role": "user", "content": _words(i, 3 + i % 9)},
                 {"role": "assistant", "content": _words(i + 1, 2 + (i * 5) % 17)}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": _words(i + 2, 4 + i % 5)},
                      {"role": "assistant", "content": _words(i + 3, 3 + i % 13)}]
        records.append({"messages": turns})
    return records


def alpaca_records(n: int = ALPACA_RECORDS) -> list[dict]:
    return [{"instruction": _words(i, 4 + i % 5), "input": _words(i + 5, 3) if i % 2 else "",
             "output": _words(i + 9, 5 + i % 7)} for i in range(n)]


def texts(n: int = TEXTS) -> list[str]:
    return [_words(i, 20 + i % 40) + "." for i in range(n)]


def chat_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of WORDS with CHAT_TEMPLATE, saved in `directory` (its ids fit MODEL_VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS), "user assistant system :"],
                            trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def _model(directory: Path, tokenizer: Path) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=MODEL_VOCAB, max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for path in tokenizer.iterdir():  # the model's own tokenizer: the chat one
        shutil.copy(path, directory / path.name)


def _text_tokenizer(directory: Path, lines: list[str]) -> None:
    """torchtitan's HuggingFaceTokenizer reads tokenizer.json and bos/eos from tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"]))
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _sentencepiece(out: Path, corpus: Path, python: str | None) -> bool:
    """Train tokenizer.model with `python` (or this interpreter); False where this interpreter lacks sentencepiece."""
    done = subprocess.run([python or sys.executable, "-c", _SENTENCEPIECE, str(corpus), str(out / "tokenizer")],
                          capture_output=True, text=True)
    if done.returncode == 0 or python is None:
        return done.returncode == 0
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise ConfigError("raybench example-data", [Problem(
        "--sentencepiece-python", python, f"could not train a SentencePiece model ({last}); name an interpreter "
        "that has sentencepiece (torchtune's environment: scripts/torchtune-venv.sh)")])


def write(out: Path, sentencepiece_python: str | None = None) -> list[str]:
    """Everything above into `out`; what was written, one line each (tokenizer.model's line says why it is not,
    where it is not)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in chat_records()) + "\n")
    chat_tokenizer(out / "chat-tokenizer")
    _model(out / "tiny-model", out / "chat-tokenizer")
    alpaca = alpaca_records()
    (out / "alpaca.json").write_text(json.dumps(alpaca))
    lines = texts()
    (out / "text").mkdir(exist_ok=True)
    (out / "text" / "part-0.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines) + "\n")
    _text_tokenizer(out / "text-tokenizer", lines)
    corpus = out / "sentencepiece-corpus.txt"
    corpus.write_text("\n".join(" ".join(r.values()) for r in alpaca) + f"\n{ALPACA_PROMPT}\n")
    trained = _sentencepiece(out, corpus, sentencepiece_python)
    corpus.unlink()
    if trained:
        (out / "tokenizer.vocab").unlink(missing_ok=True)  # the model file holds it
    made = [f"chat.jsonl: {CHATS} conversations", "chat-tokenizer/: word level, with a chat template",
            "tiny-model/: a 2-layer Llama, safetensors", f"alpaca.json: {ALPACA_RECORDS} records",
            f"text/: {TEXTS} texts", "text-tokenizer/: byte-level BPE"]
    return [f"{out}/{line}" for line in made] + [
        f"{out}/tokenizer.model: SentencePiece" if trained else
        "no tokenizer.model (stack-torchtune-cpu's): this interpreter has no sentencepiece; run again with "
        "--sentencepiece-python naming torchtune's environment's interpreter (scripts/torchtune-venv.sh)"]


def _example_data(args) -> int:
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("raybench example-data", [Problem("DIR", args.dir, "is a file; name a directory (made "
                                                            "if missing), e.g. sweeps/example-data")])
    for line in write(out, args.sentencepiece_python):
        print(line)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("example-data", help="write the tiny model, tokenizers and data the shipped CPU sweeps read "
                                            "(raybench example-data sweeps/example-data)")
    p.add_argument("dir", help="where (sweeps/example-data: the shipped sweeps' example-data/ paths)")
    p.add_argument("--sentencepiece-python", metavar="PYTHON", help="an interpreter with sentencepiece (torchtune's "
                   "environment) to train tokenizer.model for stack-torchtune-cpu")
    p.set_defaults(func=_example_data)
