"""A sweep's data, prepared once before any trial starts: the one call the sweep's driver makes for it
(`with_prepared_data`).

For each planned trial, the data its ranks read, as a `TokenizedData` handle in the trial's payload:
- hf data: every distinct data spec (and tokenizer) tokenized once into the store's cache, or found there from an
  earlier sweep (data.tokenized); then each layout (seq_len, packing, overflow, pack order) laid out once, with its
  packing efficiency and what the overflow cuts (data.packing.for_trial);
- JSON data: each layout tokenized and laid out once into the same cache (data.json_rows.prepare_json).
A stack that reads its own data, synthetic data and every other source get None: raybench's tokenization would not
describe what they train on (the stack registry's `tokenized_data`).

A build that fails is bad input (ConfigError on data.path): nothing has been launched or written. What an
overflow leaves out is always said, never silent: the trial trains on less than the data holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol, TypeVar

from raybench.data import packing, tokenized
from raybench.spec import stacks, tokenized_data
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.payload import TrialPayload
from raybench.spec.sweep_spec import TrialConfig
from raybench.spec.tokenized_data import TokenizedData


class Planned(Protocol):
    """What this needs of a planned trial (planning.plan.PlannedTrial, a frozen dataclass, is one)."""
    status: str
    config: TrialConfig
    payload: TrialPayload


T = TypeVar("T", bound=Planned)


def with_prepared_data(trials: list[T], store_path: str, progress=print, source: str = "<sweep>") -> list[T]:
    """The trials, each planned trial's payload carrying its prepared data's handle (trials raybench prepares no
    data for, and trials not planned to run, as they were): each data spec tokenized once and each layout laid
    out once across all of them, in the store's cache."""
    room = _Prepared(Path(store_path).resolve() / "_cache" / "data", progress, source)
    out = []
    for t in trials:
        ref = room.for_config(t.config) if t.status == "planned" else None
        out.append(t if ref is None else dataclasses.replace(t, payload=t.payload.replace(tokenized=ref)))
    return out


class _Prepared:
    """What one sweep has prepared so far: tokenized data specs and laid-out layouts, each done once."""

    def __init__(self, cache_root: Path, progress, source: str):
        self.cache_root, self.progress, self.source = cache_root, progress, source
        self.tokenized: dict[str, tuple] = {}  # data spec and tokenizer -> (TokenizedData, tokens per sample, masks)
        self.laid_out: dict[tuple, TokenizedData] = {}  # and the trial's layout -> its TokenizedData

    def for_config(self, config: TrialConfig) -> TokenizedData | None:
        if config.data.source not in ("hf", "json") or not stacks.kind(config.stack.kind).tokenized_data:
            return None
        return self._json(config) if config.data.source == "json" else self._hf(config)

    def _hf(self, config: TrialConfig) -> TokenizedData:
        data, seq_len = config.data, config.train.seq_len
        key, tokenizer = tokenized.spec_key(data, config.model.path)
        if key not in self.tokenized:
            ref = self._built(lambda: tokenized.prepare(data, tokenizer, self.cache_root), data.path)
            took = f" in {ref.build_s:.1f} s" if ref.build_s is not None else ""
            self.progress(f"data {ref.name}: {ref.samples} samples, cache {ref.cache}{took} ({ref.key})")
            cached = tokenized_data.load(ref.path)
            masks = cached.data.column("assistant_masks") if "assistant_masks" in cached.column_names else None
            self.tokenized[key] = ref, tokenized_data.lengths(cached), masks
        # A sweep's trials share a few layouts: each one's rows are laid out once (best fit over 10^6 samples: ~1 s).
        layout = (key, seq_len, data.packing, data.overflow, data.pack_order)
        if layout not in self.laid_out:
            ref, counts, masks = self.tokenized[key]
            self.laid_out[layout] = packing.for_trial(ref, seq_len, data, counts, masks)
            self._say_cut(self.laid_out[layout], seq_len, f"{data.overflow}; data.overflow split or drop, or a "
                          "longer train.seq_len, keeps more")
        return self.laid_out[layout]

    def _json(self, config: TrialConfig) -> TokenizedData:
        from raybench.data import json_rows  # torch: only a sweep of JSON data loads it here

        data, seq_len = config.data, config.train.seq_len
        layout = ("json", data.path, data.tokenizer or config.model.path, seq_len, data.packing, data.overflow)
        if layout not in self.laid_out:
            ref = self._built(lambda: json_rows.prepare_json(data, config.model.path, seq_len, self.cache_root.parent,
                                                             tokenized.data_hash(data.path)), data.path)
            self.laid_out[layout] = ref
            took = f" in {ref.build_s:.1f} s" if ref.build_s is not None else ""
            self.progress(f"data {ref.name} at seq_len {seq_len}: {ref.samples} samples, cache {ref.cache}{took} "
                          f"({ref.key})")
            self._say_cut(ref, seq_len, f"{data.overflow}; data.packing true with overflow truncate, where samples "
                          "run on across rows, or a longer train.seq_len keeps them")
        return self.laid_out[layout]

    def _built(self, build, path: str) -> TokenizedData:
        try:
            return build()
        except Exception as err:  # a record past the first that cannot be rendered, an unreadable file, too few rows
            raise ConfigError(self.source, [Problem("data.path", path, f"cannot be tokenized: "
                                                    f"{type(err).__name__}: {err}")]) from None

    def _say_cut(self, ref: TokenizedData, seq_len: int, fix: str) -> None:
        note = ref.cut_note()
        if note:
            self.progress(f"data {ref.name} at seq_len {seq_len}: {note} ({fix})")
