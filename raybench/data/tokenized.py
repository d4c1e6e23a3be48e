"""Real data, tokenized once per sweep (data.source: hf).

Records are read with the `datasets` library from local files or a saved dataset, rendered (plain text, the
tokenizer's own chat template, or the Alpaca prompt), tokenized whole, and saved in the store's cache as Arrow
(save_to_disk) under a key that hashes the data files, the tokenizer files and the options. Every trial and rank,
of this sweep and of later ones, memory-maps those files (spec.tokenized_data.load): nothing is tokenized or
copied again. Truncating or splitting to seq_len, padding or packing are per trial (data.packing lays out the
rows, runtime.data builds the batches), so one cache serves every seq_len and layout.

`problems` checks a data spec's content before anything starts (plan calls it), `prepare` builds or finds the
cache (the driver calls it before the first trial), `dataset` hands the tokenized `datasets.Dataset` to any
other training stack. datasets, transformers and numpy load on first use: planning stays light.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from raybench.data.records import is_saved_dataset, text_field
from raybench.data.records import problems as record_problems
from raybench.spec.errors import Problem
from raybench.spec.sweep_spec import DataSpec
from raybench.spec.tokenized_data import (TokenizedData, alpaca_prompt, format_record, lengths, load, offline_datasets,
                                          tokenizer_digest)

# Bump when what a cache directory holds changes: older entries are then never read (2: no label on the
# whitespace after an assistant turn; the {% generation %} markers' mask).
CACHE_VERSION = 2
META_FILE = "raybench.json"  # what a cache entry is, written into it before it becomes visible
# The data fields that decide the token ids (packing, seq_len and the loader's fields are per trial).
CONTENT_FIELDS = ("format", "field", "loss_on", "split", "max_samples")
# A chat template's marker of the assistant's tokens (transformers' return_assistant_tokens_mask reads it).
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Above this many records the build tokenizes in several processes (below, starting them costs more).
PARALLEL_RECORDS = 50_000


def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def read_split(data: DataSpec, streaming: bool, cache_dir: str):
    """The records of data.split: a saved dataset is memory-mapped as it is; files are read by the builder
    their suffix names (or, for a directory, the one datasets infers), converted to Arrow in cache_dir."""
    datasets = offline_datasets()
    path = Path(data.path)
    if is_saved_dataset(path):
        saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if data.split not in saved:
                raise KeyError(f"no split '{data.split}'; the saved dataset has {', '.join(saved)}")
            saved = saved[data.split]
        return saved.to_iterable_dataset() if streaming else saved
    if path.is_dir():
        return datasets.load_dataset(str(path), split=data.split, streaming=streaming, cache_dir=cache_dir)
    # A single file is the split "train", as datasets names it.
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}[path.suffix]
    return datasets.load_dataset(builder, data_files=str(path), split=data.split, streaming=streaming,
                                 cache_dir=cache_dir)


def _render(rec: dict, data: DataSpec, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """A record's text and the character spans the loss counts (empty: all of it)."""
    if data.format == "text":
        return rec[text_field(data)], []
    if data.format == "alpaca":
        prompt, text = alpaca_prompt(rec), format_record(rec)
        return text, [(len(prompt), len(text))]
    messages = rec[text_field(data)]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if data.loss_on == "all":
        return text, []
    return text, _assistant_spans(messages, text, tokenizer)


def _assistant_spans(messages: list[dict], text: str, tokenizer) -> list[tuple[int, int]]:
    """Where each assistant turn sits in the rendered conversation: after the conversation before it with the
    generation prompt, up to the conversation including it, less the whitespace the template writes after the
    turn's end (the newline after Qwen's <|im_end|>: the model is not taught to write it, as it is not after the
    last turn). Works with any template that renders a conversation's beginning the same whatever follows (most
    do); a template with `{% generation %}` markers gets their mask instead (`encoder`)."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError("the chat template renders an earlier turn differently once later turns follow, so "
                             "assistant turns cannot be located; use loss_on: all")
        spans.append((len(before), len(upto.rstrip())))
    return spans


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks the assistant's tokens with {% generation %} blocks."""
    return bool(GENERATION_MARKER.search(tokenizer.chat_template or ""))


def encoder(data: DataSpec, tokenizer):
    """The batched map function: records → input_ids, and assistant_masks (1: in the loss) for loss_on assistant.

    Plain text and Alpaca records get the tokenizer's special tokens and an end-of-sequence token; a chat
    template writes its own. assistant_masks is the column name TRL's SFTTrainer reads for the same purpose.
    Messages under a template with {% generation %} markers take the mask the markers give (transformers'
    return_assistant_tokens_mask, as TRL's assistant_only_loss); other templates, each assistant turn's span
    (`_assistant_spans`)."""
    import numpy as np

    special = data.format != "messages"
    eos = tokenizer.eos_token_id
    masked = data.loss_on == "assistant"
    if masked and data.format == "messages" and has_generation_markers(tokenizer):
        return functools.partial(_encode_marked, field=text_field(data), tokenizer=tokenizer)

    def encode(batch: dict) -> dict:
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        rendered = [_render(rec, data, tokenizer) for rec in records]
        enc = tokenizer([text for text, _ in rendered], add_special_tokens=special, return_offsets_mapping=masked)
        out = {"input_ids": []}
        if masked:
            out["assistant_masks"] = []
        for i, ids in enumerate(enc["input_ids"]):
            tail = [eos] if special and eos is not None else []
            out["input_ids"].append(list(ids) + tail)
            if masked:  # a token is in the loss when it starts inside a counted span
                starts = np.array([start for start, _ in enc["offset_mapping"][i]], dtype=np.int64)
                inside = np.zeros(len(starts), dtype=bool)
                for lo, hi in rendered[i][1]:
                    inside |= (starts >= lo) & (starts < hi)
                # The end-of-sequence token closes the response: the model must learn to stop.
                out["assistant_masks"].append(inside.astype(np.int8).tolist() + [1] * len(tail))
        return out

    return encode


def _encode_marked(batch: dict, field: str, tokenizer) -> dict:
    """Conversations tokenized by their template, the assistant's tokens those inside its {% generation %} blocks."""
    enc = tokenizer.apply_chat_template(batch[field], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return {"input_ids": [list(ids) for ids in enc["input_ids"]],
            "assistant_masks": [list(mask) for mask in enc["assistant_masks"]]}


def _features(data: DataSpec):
    datasets = offline_datasets()
    columns = {"input_ids": datasets.List(datasets.Value("int32"))}
    if data.loss_on == "assistant":
        columns["assistant_masks"] = datasets.List(datasets.Value("int8"))
    return datasets.Features(columns)


# ---- checks before anything starts --------------------------------------------------------------------------

def problems(data: DataSpec, tokenizer_dir: str) -> list[Problem]:
    """What is wrong with a data spec's content: a directory of mixed formats, records of the wrong shape (every
    record: data.records), unreadable data, a missing split, a tokenizer without a chat template when messages
    need one, a first record the tokenizer cannot render."""
    found = record_problems(data)
    if found:
        return found
    try:
        with tempfile.TemporaryDirectory(prefix="raybench-data-check-") as scratch:
            first = next(iter(read_split(data, streaming=True, cache_dir=scratch)), None)
    except StopIteration:  # datasets' JSON reader on empty files: nothing to infer the columns from
        return [Problem("data.path", data.path, f"holds no records: split '{data.split}' of {data.path} is empty; "
                        "point data.path at records")]
    except KeyError as err:
        return [Problem("data.split", data.split, f"{err.args[0]}; set data.split to one of them")]
    except ValueError as err:  # datasets' unknown split: 'Unknown split "x". Should be one of [...]'
        if "split" in str(err).lower():
            return [Problem("data.split", data.split, f"{err}; set data.split to one of them")]
        return [Problem("data.path", data.path, f"cannot be read as a dataset: {err}")]
    except Exception as err:  # a malformed file: datasets raises many kinds of errors
        return [Problem("data.path", data.path, f"cannot be read as a dataset: {type(err).__name__}: {err}")]
    if first is None:
        return [Problem("data.path", data.path, f"holds no records: split '{data.split}' of {data.path} is empty; "
                        "point data.path at records")]
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except Exception as err:
        return [Problem("data.tokenizer", tokenizer_dir, f"cannot load a tokenizer from it: {err}")]
    if data.format == "messages" and not tokenizer.chat_template:
        return [Problem("data.tokenizer", tokenizer_dir, "has no chat template (tokenizer_config.json "
                        "chat_template, or chat_template.jinja) to render messages; use a chat model's tokenizer, "
                        "or format: text with a text column")]
    if data.loss_on == "assistant" and not tokenizer.is_fast:
        return [Problem("data.loss_on", data.loss_on, "finding assistant tokens needs a fast tokenizer "
                        "(tokenizer.json); use loss_on: all")]
    try:
        encoder(data, tokenizer)({k: [v] for k, v in first.items()})
    except Exception as err:
        return [Problem("data.format", data.format, f"the first record cannot be rendered: {err}")]
    return []


def vocabulary_problem(tokenizer_dir: str, vocab_size: int, model: str) -> Problem | None:
    """A tokenizer with more tokens than the model has embedding rows: every trial would die on an IndexError.
    A tokenizer that does not load gives none here (the data checks, or the trial, say why)."""
    try:
        size = len(load_tokenizer(tokenizer_dir))  # added tokens included: they are ids the data can hold
    except Exception:
        return None
    if size <= vocab_size:
        return None
    return Problem("data.tokenizer", tokenizer_dir, f"has {size} tokens (len(tokenizer), added tokens included) but "
                   f"the model ({model}) has vocab_size {vocab_size}, so token ids from {vocab_size} on have no "
                   f"embedding row; use the model's own tokenizer, or a model with vocab_size of at least {size} "
                   "(resize its embeddings first)")


# ---- the cache ----------------------------------------------------------------------------------------------

def _digest(h, root: Path, files: list[Path]) -> None:
    for path in files:
        h.update(str(path.relative_to(root) if path != root else path.name).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)


def _data_files(path: Path) -> list[Path]:
    """Every file of the data (a directory's files, hidden ones aside: a repository's .git holds copies)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def data_hash(path: str) -> str:
    h = hashlib.sha256()
    root = Path(path)
    _digest(h, root, _data_files(root))
    return h.hexdigest()[:24]


def spec_key(data: DataSpec, model_path: str | None) -> tuple[str, str]:
    """(key, tokenizer directory) of a data spec: trials whose keys are equal tokenize to the same data (before
    any file is read: plan checks and the driver prepares each distinct key once)."""
    tokenizer = data.tokenizer or model_path
    return json.dumps([data.model_dump(mode="json", include={"path", *CONTENT_FIELDS}), tokenizer]), tokenizer


def cache_key(data: DataSpec, tokenizer_dir: str, hashed_data: str) -> str:
    """Hash of the data's content, the tokenizer's (the key every tokenization cache shares), the options that
    change the token ids, and the versions of the code that produces them: a changed file or option never hits a
    stale entry."""
    import tokenizers
    import transformers

    options = data.model_dump(include=set(CONTENT_FIELDS))
    return hashlib.sha256(json.dumps({"v": CACHE_VERSION, "data": hashed_data, "options": options,
                                      "tokenizer": tokenizer_digest(tokenizer_dir),
                                      "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
                                     sort_keys=True).encode()).hexdigest()[:24]


def prepare(data: DataSpec, tokenizer_dir: str, cache_root: str | Path) -> TokenizedData:
    """The tokenized data in cache_root: found there, or built now. Concurrent builders (two sweeps on one store,
    a stack's own `dataset` calls) each build into a temporary directory and the first rename wins."""
    hashed = data_hash(data.path)
    key = cache_key(data, tokenizer_dir, hashed)
    final = Path(cache_root) / f"hf-{key}"
    if (final / META_FILE).is_file():  # the store may have moved since the build: the path is where it is now
        meta = json.loads((final / META_FILE).read_text())
        return TokenizedData(**{**meta, "path": str(final)}, cache="hit", build_s=None)
    t0 = time.perf_counter()
    made = _make_dirs(Path(cache_root))
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache_root))
    try:
        meta = _build(data, tokenizer_dir, key, hashed, final, work)
        try:
            os.rename(work / "out", final)
        except OSError:  # another builder's copy landed first: same key, same content
            if not (final / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        # A failed build leaves nothing in the store, not even the folders it made for the entry; a built entry (or
        # another build's) is in them, and a folder that is not empty stays.
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()
    return TokenizedData(**meta, cache="build", build_s=time.perf_counter() - t0)


def _make_dirs(path: Path) -> list[Path]:
    """Make path and its missing parents; those it made, deepest first."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return missing


def _build(data: DataSpec, tokenizer_dir: str, key: str, hashed: str, final: Path, work: Path) -> dict:
    records = read_split(data, streaming=False, cache_dir=str(work / "hf"))
    if data.max_samples is not None:
        records = records.select(range(min(data.max_samples, len(records))))
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenized = records.map(
        encoder(data, tokenizer), batched=True, remove_columns=records.column_names, features=_features(data),
        # Written under the build's directory, never next to the user's saved dataset.
        cache_file_name=str(work / "hf" / "tokenized.arrow"), load_from_cache_file=False,
        num_proc=min(os.cpu_count() or 1, 8) if len(records) >= PARALLEL_RECORDS else None)
    tokenized.save_to_disk(str(work / "out"))
    counts = lengths(tokenized)
    if len(counts) == 0:
        raise ValueError(f"{data.path}: split '{data.split}' holds no records")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    meta = {"key": key, "path": str(final), "name": Path(data.path).name, "data_hash": hashed,
            "samples": len(counts), "tokens_mean": float(counts.mean()), "tokens_max": int(counts.max()),
            "pad_id": int(pad or 0)}
    (work / "out" / META_FILE).write_text(json.dumps(meta, sort_keys=True))
    return meta


def dataset(data: DataSpec, cache_root: str | Path, tokenizer_dir: str | None = None):
    """The tokenized `datasets.Dataset` of a data spec (input_ids, and assistant_masks for loss_on assistant),
    for any training stack: from cache_root when it is there (a store's `_cache/data`, where `raybench run`
    puts it), else tokenized into it."""
    return load(prepare(data, tokenizer_dir or data.tokenizer, cache_root).path)
