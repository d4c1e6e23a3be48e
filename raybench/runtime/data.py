"""Training batches: synthetic tokens, alpaca-style JSON/JSONL tokenized with a local tokenizer, or real data
tokenized once per sweep (data.source hf: planning.tokenized, before launch) and laid out per batch here.

Every batch is a dict of input_ids and labels of shape [micro_batch, seq_len], plus an attention_mask when
the data has padding. Packed and synthetic data fill every position, so they carry no mask: every token counts
as non-padding, and the model is not handed an all-ones mask that transformers would inspect on the device
(a host sync per micro-batch inside the timed step). Padded data masks the padding in the loss (labels -100)
and in the non-padding token count.

hf data is read from the memory-mapped cache by index, and each batch is built by the loader's collate function
(in its worker processes when data.num_workers > 0): samples longer than seq_len truncated, dropped or split into
seq_len-long pieces (data.overflow), padded one per row or packed several per row (in order or best fit,
data.pack_order), labels, masks and position ids; the batch is seq_len wide, or as wide as its longest row
(data.pad_to longest, so [micro_batch, width] with width <= seq_len). A packed row gives each sample its own
position ids from 0 and no attention_mask: transformers then finds the sequences from the position ids (masking_utils'
find_packed_sequence_indices) and masks attention block-causally, each sample attending to itself only; sdpa and
eager get that as a dense [b, 1, s, s] mask, flex_attention as a BlockMask built from the position ids (no dense
mask: the batch is the same as sdpa's), flash_attention_2 gets the sequences' boundaries (cu_seq_lens) and runs its
variable-length kernel with no mask at all. A packed row's padded tail is a sequence of its own, out of the loss.
Such batches carry their non-padding token count (NONPAD_TOKENS), which the timed loop takes out of the batch.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from raybench.runtime.packing import cut, layout_rows
from raybench.spec import tokenized_data
from raybench.spec.presets import ModelShape
from raybench.spec.sweep_spec import DataSpec, TrialConfig
from raybench.spec.tokenized_data import TokenizedData, format_record

IGNORE_INDEX = -100
SYNTHETIC_POOL_BATCHES = 16  # distinct synthetic micro-batches per rank; cycled after that
NONPAD_TOKENS = "nonpad_tokens"  # a batch's own count of its non-padding tokens (hf data), not a model input


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
    holds and what data.overflow cuts, counted as for hf data (runtime.packing.cut; every token a label)."""
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


class _ListColumn:
    """Sample i of an Arrow list column, as a numpy view of the memory-mapped values: nothing is copied."""

    def __init__(self, column):
        self.chunks = [(chunk.offsets.to_numpy(), chunk.values.to_numpy()) for chunk in column.chunks]
        self.starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])

    def __getitem__(self, i: int) -> np.ndarray:
        c = int(np.searchsorted(self.starts, i, side="right")) - 1
        offsets, values = self.chunks[c]
        j = i - self.starts[c]
        return values[offsets[j]:offsets[j + 1]]


class TokenRows(Dataset):
    """The rows of a trial over cached tokenized data: row r holds the pieces packing.layout_rows assigns it
    (whole samples truncated to seq_len; with overflow drop, the longer ones left out; with split, seq_len-long
    pieces of them), as views of the memory-mapped cache (every rank and loader worker shares it)."""

    def __init__(self, path: str, seq_len: int, packing: bool, overflow: str = "truncate",
                 pack_order: str = "in_order"):
        cached = tokenized_data.load(path)
        self.ids = _ListColumn(cached.data.column("input_ids"))
        masked = "assistant_masks" in cached.column_names
        self.masks = _ListColumn(cached.data.column("assistant_masks")) if masked else None
        self.rows = layout_rows(tokenized_data.lengths(cached), seq_len, packing, overflow, pack_order)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        rows = self.rows
        return [self._piece(int(rows.sample[p]), int(rows.start[p]), int(rows.length[p]))
                for p in range(rows.bounds[r], rows.bounds[r + 1])]

    def _piece(self, sample: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        end = start + length
        return self.ids[sample][start:end], None if self.masks is None else self.masks[sample][start:end]


def batch_width(longest_row: int, seq_len: int, pad_to: str = "seq_len", pad_multiple: int = 1) -> int:
    """Positions per row of a micro-batch: seq_len, or (pad_to longest) its longest row's real tokens rounded up
    to pad_multiple, never above seq_len, and at least one position."""
    if pad_to == "seq_len":
        return seq_len
    return min(seq_len, -(-max(longest_row, 1) // pad_multiple) * pad_multiple)


def collate_rows(rows: list, seq_len: int, pad_id: int, packing: bool, varlen: bool, pad_to: str = "seq_len",
                 pad_multiple: int = 1) -> dict:
    """One micro-batch from TokenRows items: the per-batch work of a real loader (see the module doc)."""
    width = batch_width(max(sum(len(tokens) for tokens, _ in samples) for samples in rows), seq_len, pad_to,
                        pad_multiple)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    filled, sequences = [], []  # real tokens per row; every sequence's length, padded tails included
    for b, samples in enumerate(rows):
        at = 0
        for tokens, loss in samples:
            n = len(tokens)
            if n == 0:  # an empty sample has no tokens to place, and no first token to unlabel
                continue
            ids[b, at:at + n] = tokens
            labels[b, at:at + n] = tokens if loss is None else np.where(loss > 0, tokens, IGNORE_INDEX)
            # No sequence's first token is predicted from the token before it (another sample's, when packed).
            labels[b, at] = IGNORE_INDEX
            positions[b, at:at + n] = np.arange(n)
            sequences.append(n)
            at += n
        if at < width:
            positions[b, at:] = np.arange(width - at)
            sequences.append(width - at)
        filled.append(at)
    batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), NONPAD_TOKENS: sum(filled)}
    if packing:
        batch["position_ids"] = torch.from_numpy(positions)
        if varlen:  # flash_attention_2: the sequences' boundaries over the flattened batch, for its varlen kernel
            cu = torch.from_numpy(np.cumsum([0] + sequences).astype(np.int32))
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(sequences),
                         max_length_k=max(sequences))
    elif min(filled) < width:  # no all-ones mask (see the module doc)
        batch["attention_mask"] = torch.from_numpy((np.arange(width) < np.array(filled)[:, None]).astype(np.int64))
    return batch


def require_tokenized(ref: TokenizedData | None) -> TokenizedData:
    """The hf data the sweep's driver tokenized before launch (drivers.api.tokenize_once puts it in the payload).
    A rank only opens it: tokenizing is the plan's job (planning.tokenized), once per sweep."""
    if ref is None:
        raise ValueError("data.source hf: the trial's payload carries no tokenized data; the sweep's driver "
                         "tokenizes it before launch (`raybench run`; a payload built by hand: "
                         "raybench.drivers.api.tokenize_once)")
    return ref


def hf_rows(config: TrialConfig, ref: TokenizedData | None) -> tuple[TokenRows, object]:
    """The trial's rows and collate function over the data the driver tokenized before launch (ref)."""
    data, train = config.data, config.train
    ref = require_tokenized(ref)
    collate = functools.partial(collate_rows, seq_len=train.seq_len, pad_id=ref.pad_id, packing=data.packing,
                                varlen=config.model.attn_implementation == "flash_attention_2",
                                pad_to=data.pad_to, pad_multiple=data.pad_multiple)
    return TokenRows(ref.path, train.seq_len, data.packing, data.overflow, data.pack_order), collate


def synthetic_dataset(shape: ModelShape, micro_batch: int, seq_len: int, seed: int, rank: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    ids = torch.randint(0, shape.vocab_size, (SYNTHETIC_POOL_BATCHES * micro_batch, seq_len), generator=gen)
    return TensorDataset(ids)


def _collate(rows) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    if len(rows[0]) == 1:  # data without padding: no mask, and every token is a label
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.stack([r[1] for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def batches(config: TrialConfig, shape: ModelShape, rank: int, world_size: int,
            cache_dir: str | None = None, ref: TokenizedData | None = None) -> Iterator[dict]:
    """An endless iterator of this rank's micro-batches (epochs repeat with a new shuffle); `ref` is the hf
    data the driver tokenized for the trial."""
    train, data = config.train, config.data
    collate = _collate
    if data.source == "synthetic":
        # Each rank draws its own tokens, so no sampler is needed.
        dataset = synthetic_dataset(shape, train.micro_batch, train.seq_len, train.seed, rank)
        sampler = None
    else:
        if data.source == "hf":
            dataset, collate = hf_rows(config, ref)
        else:
            dataset = cached_text_dataset(data, config.model.path, train.seq_len, cache_dir)
        if len(dataset) < world_size * train.micro_batch:
            raise ValueError(f"{data.path}: {len(dataset)} sequences of {train.seq_len} tokens, fewer than one "
                             f"micro-batch per rank ({world_size} x {train.micro_batch}); add data or shorten seq_len")
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=train.seed, drop_last=True)
    loader = DataLoader(
        dataset,
        batch_size=train.micro_batch,
        sampler=sampler,
        shuffle=False,
        drop_last=True,
        num_workers=data.num_workers,
        pin_memory=data.pin_memory,
        # Both only exist with worker processes (torch rejects them otherwise; plan.py says so up front).
        persistent_workers=data.persistent_workers and data.num_workers > 0,
        prefetch_factor=data.prefetch_factor if data.num_workers > 0 else None,
        collate_fn=collate,
    )
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
