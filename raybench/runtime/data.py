"""Training batches: synthetic tokens, or alpaca-style JSON/JSONL tokenized with a local tokenizer.

Every batch is a dict of input_ids and labels of shape [micro_batch, seq_len], plus an attention_mask when
the data has padding. Packed and synthetic data fill every position, so they carry no mask: every token counts
as non-padding, and the model is not handed an all-ones mask that transformers would inspect on the device
(a host sync per micro-batch inside the timed step). Padded data masks the padding in the loss (labels -100)
and in the non-padding token count.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raybench.spec.presets import ModelShape
from raybench.spec.sweep_spec import DataSpec, TrialConfig

IGNORE_INDEX = -100
SYNTHETIC_POOL_BATCHES = 16  # distinct synthetic micro-batches per rank; cycled after that
PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def read_records(path: str | Path) -> list[dict]:
    """Alpaca-style records from a JSON array or JSON Lines file."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def format_record(rec: dict) -> str:
    input_block = f"### Input:\n{rec['input']}\n\n" if rec.get("input") else ""
    return PROMPT.format(instruction=rec.get("instruction", ""), input_block=input_block) + rec.get("output", "")


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


def text_dataset(data: DataSpec, model_path: str | None, seq_len: int) -> TensorDataset:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.tokenizer or model_path, local_files_only=True)
    sequences = tokenize_records(read_records(data.path), tokenizer)
    if data.packing:
        return TensorDataset(pack(sequences, seq_len))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return _dataset(*pad(sequences, seq_len, pad_id))


def _dataset(ids: torch.Tensor, mask: torch.Tensor) -> TensorDataset:
    """(input_ids, attention_mask) rows, or input_ids alone when no position is padding (see the module doc)."""
    return TensorDataset(ids) if bool(mask.all()) else TensorDataset(ids, mask)


_MEMORY_CACHE: dict[str, TensorDataset] = {}  # a warm pool actor keeps tokenized data between trials
_MEMORY_CACHE_ENTRIES = 4


def memory_cache_bytes() -> int:
    """Bytes of tokenized data this process keeps between trials (0 outside warm pool actors)."""
    return sum(t.numel() * t.element_size() for dataset in _MEMORY_CACHE.values() for t in dataset.tensors)


def _digest_files(h, paths: list[Path]) -> None:
    for path in paths:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)


def dataset_cache_key(data: DataSpec, tokenizer_dir: str, seq_len: int) -> str:
    """Content hash of (data file, tokenizer files, seq_len, packing): a changed file never hits a stale entry."""
    h = hashlib.sha256(f"v1:{seq_len}:{data.packing}".encode())
    tokenizer_files = sorted(p for p in Path(tokenizer_dir).iterdir()
                             if p.is_file() and p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")))
    _digest_files(h, [Path(data.path), *tokenizer_files])
    return h.hexdigest()[:24]


def _write_arrow(dataset: TensorDataset, path: Path) -> None:
    import pyarrow as pa  # real-data trials only: a synthetic trial's ranks never load pyarrow

    ids = dataset.tensors[0]
    # The file always holds a mask column (all ones without padding): one format for every cached file.
    mask = dataset.tensors[1] if len(dataset.tensors) > 1 else torch.ones_like(ids)
    seq_len = ids.shape[1]
    table = pa.table({
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.flatten().numpy()), seq_len),
        "attention_mask": pa.FixedSizeListArray.from_arrays(pa.array(mask.flatten().numpy().astype("int8")), seq_len),
    })
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
            cache_dir: str | None = None) -> Iterator[dict]:
    """An endless iterator of this rank's micro-batches (epochs repeat with a new shuffle)."""
    train, data = config.train, config.data
    if data.source == "synthetic":
        # Each rank draws its own tokens, so no sampler is needed.
        dataset = synthetic_dataset(shape, train.micro_batch, train.seq_len, train.seed, rank)
        sampler = None
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
        collate_fn=_collate,
    )
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
