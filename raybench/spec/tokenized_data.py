"""Tokenized data (data.source hf) as the tokenizer writes it and every rank reads it.

data.tokenized tokenizes a data spec once into the store's cache; the sweep's driver puts the entry's handle
(`TokenizedData`) in each trial's payload; every rank opens the entry from it (`load`, `lengths`) and lays out its
rows (data.packing, runtime.data). The Alpaca prompt lives here too: the hf tokenizer and the JSON loader
(data.json_rows) render records with it, so both give the same token ids. datasets, pyarrow and numpy load on
first use: the spec layer stays light.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

# Tokenizer files whose content decides the token ids: the vocabulary and merges (tokenizer.json, vocab.*,
# merges.txt, a sentencepiece model), added and special tokens, the tokenizer config (which may hold the chat
# template) and the chat template of its own (chat_template.jinja or .json).
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template", "spiece")
# Above this fraction of label tokens cut by data.overflow, the live view and the summary say so.
CUT_LABEL_NOTE_FRAC = 0.01
PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


@dataclass(frozen=True)
class TokenizedData:
    """A tokenized dataset in the store's cache, as a trial's payload carries it to every rank."""

    key: str  # hash of the data files, the tokenizer files and the options
    path: str  # the save_to_disk directory
    cache: str  # "hit" (found in the store) or "build" (tokenized by this sweep)
    build_s: float | None  # seconds the build took; None on a hit
    name: str  # the data path's last component
    data_hash: str  # hash of the data files alone
    samples: int
    tokens_mean: float  # tokens per sample, before truncation to seq_len
    tokens_max: int
    pad_id: int
    packing_efficiency: float | None = None  # per trial (seq_len and data layout): real tokens / row positions
    # Per trial too: what data.overflow leaves out at seq_len (data.packing.cut).
    samples_cut: int | None = None
    tokens_cut: int | None = None
    label_tokens_cut: int | None = None
    label_tokens_cut_frac: float | None = None  # of all the data's label tokens

    def row_fields(self) -> dict:
        """The row's data columns (docs/schema.md)."""
        return {"dataset_name": self.name, "dataset_hash": self.data_hash, "data_cache_key": self.key,
                "data_cache": self.cache, "data_build_s": self.build_s, "data_samples": self.samples,
                "sample_tokens_mean": self.tokens_mean, "sample_tokens_max": self.tokens_max,
                "packing_efficiency": self.packing_efficiency, "samples_cut": self.samples_cut,
                "tokens_cut": self.tokens_cut, "label_tokens_cut": self.label_tokens_cut,
                "label_tokens_cut_frac": self.label_tokens_cut_frac}

    def cut_note(self, threshold: float = CUT_LABEL_NOTE_FRAC) -> str | None:
        """A line on what the trial's overflow cut, when it cut more than `threshold` of the label tokens."""
        if self.label_tokens_cut_frac is None or self.label_tokens_cut_frac <= threshold:
            return None
        return (f"data.overflow cut {self.samples_cut} of {self.samples} samples, {self.tokens_cut} tokens and "
                f"{self.label_tokens_cut_frac:.1%} of the label tokens")


def tokenizer_digest(directory: str) -> str:
    """Hash of a tokenizer directory's files that decide the token ids (TOKENIZER_FILES): the one tokenizer key of
    every tokenization cache (the hf data's, data.tokenized; the JSON data's, data.json_rows), so a changed
    chat template, added token or tokenizer config never hits a stale entry."""
    h = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILES)):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def format_record(rec: dict) -> str:
    """An Alpaca record as one text: the prompt, then the response."""
    return alpaca_prompt(rec) + (rec.get("output") or "")


def alpaca_prompt(rec: dict) -> str:
    input_block = f"### Input:\n{rec['input']}\n\n" if rec.get("input") else ""
    return PROMPT.format(instruction=rec.get("instruction") or "", input_block=input_block)


def offline_datasets():
    """The `datasets` module, set to local files only."""
    # Never reach for a hub, in the driver or in a rank (datasets reads this at its import; a rank's worker module
    # has set it already, so a warm actor's environment is left as it was).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()  # the sweep's own progress view owns the terminal
    return datasets


def load(path: str):
    """The cached tokenized dataset, memory-mapped."""
    return offline_datasets().load_from_disk(path)


def lengths(tokenized):
    """Tokens per sample of a tokenized dataset, from the Arrow list offsets (no token is read)."""
    import numpy as np
    import pyarrow.compute as pc

    column = tokenized.data.column("input_ids")
    return np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)
