"""A rank's training batches: synthetic tokens, or the rows the sweep's driver prepared before launch
(raybench.data: JSON data's rows, data.json_rows; hf data tokenized once, data.tokenized), batched here.

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

import functools
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from raybench.data.json_rows import cached_text_dataset
from raybench.data.packing import layout_rows
from raybench.spec import tokenized_data
from raybench.spec.presets import ModelShape
from raybench.spec.sweep_spec import TrialConfig
from raybench.spec.tokenized_data import TokenizedData

IGNORE_INDEX = -100
SYNTHETIC_POOL_BATCHES = 16  # distinct synthetic micro-batches per rank; cycled after that
NONPAD_TOKENS = "nonpad_tokens"  # a batch's own count of its non-padding tokens (hf data), not a model input


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
    """The hf data the sweep's driver tokenized before launch (data.prepare.with_prepared_data put it in the
    payload).
    A rank only opens it: tokenizing is the plan's job (data.tokenized), once per sweep."""
    if ref is None:
        raise ValueError("data.source hf: the trial's payload carries no tokenized data; the sweep's driver "
                         "tokenizes it before launch (`raybench run`; a payload built by hand: "
                         "raybench.data.prepare.with_prepared_data)")
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
