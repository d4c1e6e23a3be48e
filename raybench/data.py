"""Training batches: synthetic tokens, or alpaca-style JSON/JSONL tokenized with a local tokenizer.

Every batch is a dict of input_ids, attention_mask and labels of shape [micro_batch, seq_len]. Packed data
fills every position (all tokens count as non-padding); padded data masks the padding in the loss (labels
-100) and in the non-padding token count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raybench.config import DataSpec, TrialConfig
from raybench.presets import ModelShape

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
        ids = pack(sequences, seq_len)
        return TensorDataset(ids, torch.ones_like(ids))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return TensorDataset(*pad(sequences, seq_len, pad_id))


def synthetic_dataset(shape: ModelShape, micro_batch: int, seq_len: int, seed: int, rank: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    ids = torch.randint(0, shape.vocab_size, (SYNTHETIC_POOL_BATCHES * micro_batch, seq_len), generator=gen)
    return TensorDataset(ids, torch.ones_like(ids))


def _collate(rows) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    mask = torch.stack([r[1] for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def batches(config: TrialConfig, shape: ModelShape, rank: int, world_size: int) -> Iterator[dict]:
    """An endless iterator of this rank's micro-batches (epochs repeat with a new shuffle)."""
    train, data = config.train, config.data
    if data.source == "synthetic":
        # Each rank draws its own tokens, so no sampler is needed.
        dataset = synthetic_dataset(shape, train.micro_batch, train.seq_len, train.seed, rank)
        sampler = None
    else:
        dataset = text_dataset(data, config.model.path, train.seq_len)
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
        persistent_workers=data.num_workers > 0,
        collate_fn=_collate,
    )
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
