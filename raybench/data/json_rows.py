"""JSON data (data.source json): alpaca-style records from a JSON array or JSON Lines file, tokenized with a local
tokenizer and laid out for one seq_len (packed, or one padded sample per row; data.overflow drop leaves the longer
ones out first).

The sweep's driver lays out each layout once before launch (`prepare_json`, through data.prepare) into the
store's cache as Arrow, with the samples' token counts in the file's metadata (a later sweep reads them instead of
tokenizing again); every rank then reads that file (`cached_text_dataset`), and a warm pool actor keeps the last
few in memory between trials.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from raybench.data.packing import cut
from raybench.spec import tokenized_data
from raybench.spec.sweep_spec import DataSpec
from raybench.spec.tokenized_data import TokenizedData, format_record

def read_records(path: str | Path) -> list[dict]:
    """Alpaca-style records from a JSON array or JSON Lines file."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def tokenize_records(records: list[dict], tokenizer) -> list[list[int]]:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [tokenizer(format_record(r), add_special_tokens=True)["input_ids"] + eos for r in records]


def pack(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate all examples and cut full rows of seq_len tokens (the ragged tail is dropped)."""
    flat = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    rows = flat.numel() // seq_len
    if rows == 0:
        raise ValueError(f"the data holds {flat.numel()} tokens, fewer than one sequence of {seq_len}")
    return flat[: rows * seq_len].view(rows, seq_len)


def pad(sequences: list[list[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate or right-pad each example to seq_len; returns (input_ids, attention_mask)."""
    ids = torch.full((len(sequences), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), seq_len), dtype=torch.long)
    for i, seq in enumerate(sequences):
        seq = seq[:seq_len]
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids, mask


def json_sequences(data: DataSpec, model_path: str | None) -> tuple[list[list[int]], int]:
    """(token ids of every record, the padding id) of JSON data, before any cut to seq_len."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.tokenizer or model_path, local_files_only=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return tokenize_records(read_records(data.path), tokenizer), pad_id


def lay_out_json(sequences: list[list[int]], data: DataSpec, seq_len: int, pad_id: int) -> TensorDataset:
    """JSON data's rows: with data.overflow drop, every sample longer than seq_len left out first; then packed
    (samples concatenated and cut into rows, so none is truncated) or one padded sample per row (truncated)."""
    if data.overflow == "drop":
        sequences = [seq for seq in sequences if len(seq) <= seq_len]
    if data.packing:
        return TensorDataset(pack(sequences, seq_len))
    if not sequences:
        raise ValueError(f"no sample of {data.path} holds at most {seq_len} tokens, and data.overflow drop left "
                         "out every longer one")
    return _dataset(*pad(sequences, seq_len, pad_id))


def text_dataset(data: DataSpec, model_path: str | None, seq_len: int) -> TensorDataset:
    sequences, pad_id = json_sequences(data, model_path)
    return lay_out_json(sequences, data, seq_len, pad_id)


def _dataset(ids: torch.Tensor, mask: torch.Tensor) -> TensorDataset:
    """(input_ids, attention_mask) rows, or input_ids alone when no position is padding (see the module doc)."""
    return TensorDataset(ids) if bool(mask.all()) else TensorDataset(ids, mask)


_MEMORY_CACHE: dict[str, TensorDataset] = {}  # a warm pool actor keeps tokenized data between trials
_MEMORY_CACHE_ENTRIES = 4


def memory_cache_bytes() -> int:
    """Bytes of tokenized data this process keeps between trials (0 outside warm pool actors)."""
    return sum(t.numel() * t.element_size() for dataset in _MEMORY_CACHE.values() for t in dataset.tensors)


def dataset_cache_key(data: DataSpec, tokenizer_dir: str, seq_len: int) -> str:
    """Content hash of (data file, tokenizer, seq_len, packing, overflow): a changed file never hits a stale entry. The
    tokenizer's part is the hf cache's too (tokenized_data.tokenizer_digest)."""
    h = hashlib.sha256(f"v3:{seq_len}:{data.packing}:{data.overflow}:"
                       f"{tokenized_data.tokenizer_digest(tokenizer_dir)}".encode())
    with open(data.path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


# What the file's rows were laid out from (prepare_json's counts), in its schema's metadata: a cache hit reads
# them instead of tokenizing the data again. Each record's token count, int64 little-endian, base64.
_SAMPLE_TOKENS, _PAD_ID = b"raybench.sample_tokens", b"raybench.pad_id"


def _write_arrow(dataset: TensorDataset, path: Path, sample_tokens: np.ndarray | None = None,
                 pad_id: int | None = None) -> None:
    import pyarrow as pa  # real-data trials only: a synthetic trial's ranks never load pyarrow

    ids = dataset.tensors[0]
    # The file always holds a mask column (all ones without padding): one format for every cached file.
    mask = dataset.tensors[1] if len(dataset.tensors) > 1 else torch.ones_like(ids)
    seq_len = ids.shape[1]
    metadata = None
    if sample_tokens is not None:
        metadata = {_SAMPLE_TOKENS: base64.b64encode(sample_tokens.astype("<i8").tobytes()),
                    _PAD_ID: str(pad_id).encode()}
    table = pa.table({
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.flatten().numpy()), seq_len),
        "attention_mask": pa.FixedSizeListArray.from_arrays(pa.array(mask.flatten().numpy().astype("int8")), seq_len),
    }, metadata=metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may write at once: each its own temp file
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    tmp.replace(path)


def _read_arrow(path: Path) -> TensorDataset:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    columns = []
    for name in ("input_ids", "attention_mask"):
        column = table.column(name).combine_chunks()
        flat = torch.from_numpy(column.values.to_numpy(zero_copy_only=False).astype("int64"))
        columns.append(flat.view(len(column), column.type.list_size))
    return _dataset(*columns)


def _cached_counts(path: Path) -> tuple[np.ndarray, int] | None:
    """The sample token counts and padding id a cached file was laid out from; None for a file written
    without them (by a rank, or before they were kept)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        metadata = pa.ipc.open_file(source).schema.metadata or {}
    if _SAMPLE_TOKENS not in metadata:
        return None
    return np.frombuffer(base64.b64decode(metadata[_SAMPLE_TOKENS]), dtype="<i8"), int(metadata[_PAD_ID])


def cached_text_dataset(data: DataSpec, model_path: str | None, seq_len: int, cache_dir: str | None) -> TensorDataset:
    """Tokenized data from this process's memory, else the store's Arrow cache, else tokenized now (and cached)."""
    key = dataset_cache_key(data, data.tokenizer or model_path, seq_len)
    if key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    path = Path(cache_dir, "data", f"{key}.arrow") if cache_dir else None
    if path is not None and path.exists():
        dataset = _read_arrow(path)
    else:
        dataset = text_dataset(data, model_path, seq_len)
        if path is not None:
            _write_arrow(dataset, path)
    if len(_MEMORY_CACHE) >= _MEMORY_CACHE_ENTRIES:
        _MEMORY_CACHE.pop(next(iter(_MEMORY_CACHE)))
    _MEMORY_CACHE[key] = dataset
    return dataset


def prepare_json(data: DataSpec, model_path: str | None, seq_len: int, cache_dir: str | Path,
                 data_hash: str) -> TokenizedData:
    """JSON data (data.source json) before launch, once per layout (seq_len, packing, overflow): its rows in the
    store's cache, where every rank finds them (cached_text_dataset), and the row's data columns: what the data
    holds and what data.overflow cuts, counted as for hf data (data.packing.cut; every token a label)."""
    t0 = time.perf_counter()
    key = dataset_cache_key(data, data.tokenizer or model_path, seq_len)
    path = Path(cache_dir, "data", f"{key}.arrow")
    cached = path.exists()
    known = _cached_counts(path) if cached else None
    if known is None:
        sequences, pad_id = json_sequences(data, model_path)
        counts = np.array([len(seq) for seq in sequences], dtype=np.int64)
    else:
        counts, pad_id = known
    dataset = _read_arrow(path) if cached else lay_out_json(sequences, data, seq_len, pad_id)
    if not cached:
        _write_arrow(dataset, path, counts, pad_id)
    # Packed, samples run on from one row into the next: truncate cuts none of them (the cut at a reach no sample
    # passes); drop leaves out the longer ones before packing, as it does padded.
    reach = int(counts.max(initial=seq_len)) if data.packing and data.overflow == "truncate" else seq_len
    left_out = cut(counts, reach, data.overflow)
    masks = dataset.tensors[1] if len(dataset.tensors) > 1 else None
    return TokenizedData(
        key=key, path=str(path), cache="hit" if cached else "build",
        build_s=None if cached else time.perf_counter() - t0, name=Path(data.path).name, data_hash=data_hash,
        samples=len(counts), tokens_mean=float(counts.mean()) if len(counts) else 0.0,
        tokens_max=int(counts.max(initial=0)), pad_id=pad_id,
        packing_efficiency=1.0 if masks is None else float(masks.float().mean()),
        samples_cut=left_out.samples, tokens_cut=left_out.tokens, label_tokens_cut=left_out.label_tokens,
        label_tokens_cut_frac=left_out.label_fraction())
