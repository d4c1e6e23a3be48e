"""A trial's rows over tokenized data (data.source hf): which samples, or pieces of samples, each row of seq_len
tokens holds.

Truncating, dropping or splitting samples longer than seq_len (data.overflow), padding or packing (data.packing)
in order or best fit (data.pack_order) are per trial: one tokenized cache (spec.tokenized_data) serves every seq_len
and layout. `layout_rows` is a pure function of the samples' lengths, so every rank computes the same rows with no
communication; runtime.data builds the batches from them. The sweep's driver computes the layout's packing
efficiency and what the overflow cuts before launch (`for_trial`), for the row. numpy loads on first use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raybench.spec.sweep_spec import DataSpec
from raybench.spec.tokenized_data import TokenizedData

if TYPE_CHECKING:
    import numpy as np


def row_bounds(counts, seq_len: int, packing: bool):
    """Which samples each row of seq_len tokens holds, as boundaries: row r is samples [b[r], b[r+1]).

    Every sample is truncated to seq_len. Padding: one sample per row. Packing: samples in order, a new row
    whenever the next one would not fit whole (the row's tail is padding), so no sample is split across rows.
    layout_rows hands it the pieces of split samples the same way (pack_order in_order: next fit)."""
    import numpy as np

    counts = np.minimum(np.asarray(counts), seq_len)
    if not packing:
        return np.arange(len(counts) + 1)
    bounds, used = [0], 0
    for i, n in enumerate(counts.tolist()):
        if used + n > seq_len:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(len(counts))
    return np.asarray(bounds)


@dataclass(frozen=True)
class Rows:
    """A trial's rows over the cached samples: row r holds pieces [bounds[r], bounds[r+1]), piece p being tokens
    [start[p], start[p] + length[p]) of sample `sample[p]` (a whole sample truncated to seq_len, or one
    seq_len-long piece of a longer one with data.overflow split). All are numpy int64 arrays."""

    bounds: np.ndarray
    sample: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.bounds) - 1


def pieces(counts, seq_len: int, overflow: str = "truncate"):
    """(sample, start, length) of every piece, in sample order: truncate keeps each sample's first seq_len tokens;
    drop leaves out every sample longer than seq_len; split cuts a longer sample into seq_len-long pieces, the last
    one shorter (an empty sample stays one piece)."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    if overflow == "truncate":
        return np.arange(len(counts)), np.zeros(len(counts), dtype=np.int64), np.minimum(counts, seq_len)
    if overflow == "drop":
        kept = np.flatnonzero(counts <= seq_len)
        return kept, np.zeros(len(kept), dtype=np.int64), counts[kept]
    per_sample = np.maximum(1, -(-counts // seq_len))
    sample = np.repeat(np.arange(len(counts)), per_sample)
    first_piece = np.cumsum(per_sample) - per_sample
    start = (np.arange(len(sample)) - np.repeat(first_piece, per_sample)) * seq_len
    return sample, start, np.minimum(counts[sample] - start, seq_len)


def layout_rows(counts, seq_len: int, packing: bool, overflow: str = "truncate",
                pack_order: str = "in_order") -> Rows:
    """The rows of a trial's layout (data.packing, overflow, pack_order at train.seq_len). A pure function of the
    sample lengths: every rank computes the same rows from the cache, with no communication."""
    import numpy as np

    sample, start, length = pieces(counts, seq_len, overflow)
    if packing and pack_order == "best_fit":
        order, bounds = best_fit_decreasing(length, seq_len)
        sample, start, length = sample[order], start[order], length[order]
    else:
        bounds = row_bounds(length, seq_len, packing)
    return Rows(np.asarray(bounds, dtype=np.int64), sample, start, length)


class _OpenRows:
    """Open rows by the room they have left, for best-fit: which row has the least room that still holds n tokens,
    in O(log seq_len). A segment tree over room 0..seq_len: each node holds the largest room with an open row
    below it (-1: none), so the smallest such room >= n is found by going left wherever the left half has one."""

    def __init__(self, seq_len: int):
        self.leaves = 1 << (seq_len + 1).bit_length()
        self.tree = [-1] * (2 * self.leaves)
        self.rows: list[list[int]] = [[] for _ in range(seq_len + 1)]  # open rows per room left

    def least_room_for(self, n: int) -> int | None:
        if self.tree[1] < n:
            return None
        node = 1
        while node < self.leaves:
            node *= 2
            if self.tree[node] < n:
                node += 1
        return node - self.leaves

    def take(self, room: int) -> int:
        """One open row with exactly this room left (the latest put there), no longer listed."""
        row = self.rows[room].pop()
        if not self.rows[room]:
            self._mark(room, -1)
        return row

    def put(self, rows, room: int) -> None:
        if not rows:
            return
        if not self.rows[room]:
            self._mark(room, room)
        self.rows[room].extend(rows)

    def _mark(self, room: int, value: int) -> None:
        node = room + self.leaves
        self.tree[node] = value
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2


def best_fit_decreasing(lengths, seq_len: int):
    """(order, bounds): pieces sorted by length, longest first, each into the open row with the least room that
    still holds it, else into a new row (best-fit decreasing; TRL's "bfd"). Row r holds pieces
    order[bounds[r]:bounds[r+1]], longest first; ties go in data order, so the rows are deterministic.

    Pieces of one length are placed together: the row that takes one of them has less room left, which is then the
    least room that holds the next one if any, so it takes as many as fit at once; a new row likewise. That is the
    piece-by-piece result with one tree search per row touched instead of per piece."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    by_length = np.argsort(-lengths, kind="stable")
    ordered = lengths[by_length]
    row_of = np.empty(len(lengths), dtype=np.int64)  # the row of each piece, in by_length order
    open_rows, rows = _OpenRows(seq_len), 0
    group_starts = np.flatnonzero(np.diff(ordered)) + 1
    for lo, hi in zip([0, *group_starts.tolist()], [*group_starts.tolist(), len(ordered)]):
        size, at = int(ordered[lo]), lo
        while at < hi and (room := open_rows.least_room_for(size)) is not None:
            row = open_rows.take(room)
            fit = min(hi - at, room // size) if size else hi - at
            row_of[at:at + fit] = row
            open_rows.put([row], room - fit * size)
            at += fit
        if at < hi:  # no open row holds another one: new rows, each filled with as many as fit
            per_row = seq_len // size if size else hi - at
            left = hi - at
            row_of[at:hi] = rows + np.arange(left) // per_row
            full, rest = divmod(left, per_row)
            open_rows.put(range(rows, rows + full), seq_len - per_row * size)
            if rest:
                open_rows.put([rows + full], seq_len - rest * size)
            rows += full + int(rest > 0)
    order = by_length[np.argsort(row_of, kind="stable")]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))])
    return order, bounds


def packing_efficiency(counts, seq_len: int, packing: bool, overflow: str = "truncate",
                       pack_order: str = "in_order") -> float:
    """Real tokens over the positions of the layout's rows, each counted seq_len wide (1: no padding at all).
    data.pad_to longest narrows the batches, not this measure: it is the layout's, not the batches' widths."""
    rows = layout_rows(counts, seq_len, packing, overflow, pack_order)
    return float(rows.length.sum() / (len(rows) * seq_len))


@dataclass(frozen=True)
class Cut:
    """What a layout leaves out of the data at seq_len (data.overflow): samples cut (truncate: their tails; drop:
    whole), their tokens, and the label tokens (those the loss would count) lost, of all the data's labels."""

    samples: int
    tokens: int
    label_tokens: int
    labels_total: int

    def label_fraction(self) -> float:
        return self.label_tokens / self.labels_total if self.labels_total else 0.0


# Labels are counted this many samples at a time (bounded memory on any dataset).
_CUT_SAMPLES_PER_SLICE = 4096


def cut(counts, seq_len: int, overflow: str, masks=None) -> Cut:
    """What data.overflow leaves out at seq_len. counts: tokens per sample; masks: the assistant_masks column (an
    Arrow list column, 1 where the loss counts the token), None when the loss counts every token. A sample's first
    token is never a label (runtime.data.collate_rows), nor is each split piece's: split loses those."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    longer = counts > seq_len
    samples = 0 if overflow == "split" else int(longer.sum())
    tokens = {"truncate": int((counts - seq_len)[longer].sum()), "drop": int(counts[longer].sum()), "split": 0}
    if masks is None:
        labels = np.maximum(counts - 1, 0)
        lost = {"truncate": np.maximum(counts - seq_len, 0), "drop": np.where(longer, labels, 0),
                "split": np.maximum(-(-counts // seq_len) - 1, 0)}[overflow]
        return Cut(samples, tokens[overflow], int(lost.sum()), int(labels.sum()))
    total = lost = 0
    for chunk in masks.chunks:
        offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False)
        for lo in range(0, len(chunk), _CUT_SAMPLES_PER_SLICE):
            bounds = offsets[lo:lo + _CUT_SAMPLES_PER_SLICE + 1]
            lengths = np.diff(bounds)
            position = np.arange(bounds[0], bounds[-1]) - np.repeat(bounds[:-1], lengths)
            labelled = (values[bounds[0]:bounds[-1]] > 0) & (position >= 1)
            if overflow == "truncate":
                gone = position >= seq_len
            elif overflow == "drop":
                gone = np.repeat(lengths > seq_len, lengths)
            else:
                gone = (position >= seq_len) & (position % seq_len == 0)
            total += int(labelled.sum())
            lost += int((labelled & gone).sum())
    return Cut(samples, tokens[overflow], lost, total)


def for_trial(ref: TokenizedData, seq_len: int, data: DataSpec, counts, masks=None) -> TokenizedData:
    """The trial's TokenizedData: its packing efficiency and what its overflow cuts, at its seq_len and data
    layout (masks: the assistant_masks column, None without one)."""
    efficiency = packing_efficiency(counts, seq_len, data.packing, data.overflow, data.pack_order)
    left_out = cut(counts, seq_len, data.overflow, masks)
    return dataclasses.replace(ref, packing_efficiency=efficiency, samples_cut=left_out.samples,
                               tokens_cut=left_out.tokens, label_tokens_cut=left_out.label_tokens,
                               label_tokens_cut_frac=left_out.label_fraction())

