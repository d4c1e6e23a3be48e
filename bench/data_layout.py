"""What the data layout options buy on a realistic length distribution, and what laying out rows costs.

    .venv/bin/python bench/data_layout.py [--samples 1000000] [--seq-len 4096]

Sample lengths are drawn log-normal (median 300 tokens, a long tail past seq_len, as chat and instruction sets
have; seed 0). For each layout: rows, packing efficiency (real tokens over seq_len-wide rows), the mean batch
width with pad_to longest (micro-batch 8, pad_multiple 64, rows in order), and the seconds `layout_rows` took.
Prints one JSON line per layout.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from raybench.data import tokenized
from raybench.runtime.data import batch_width

MICRO_BATCH, PAD_MULTIPLE = 8, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    lengths = np.maximum(1, np.random.default_rng(0).lognormal(np.log(300), 1.0, args.samples)).astype(np.int64)
    for packing, overflow, order in ((False, "truncate", "in_order"), (True, "truncate", "in_order"),
                                     (True, "split", "in_order"), (True, "truncate", "best_fit"),
                                     (True, "split", "best_fit")):
        t0 = time.perf_counter()
        rows = tokenized.layout_rows(lengths, args.seq_len, packing, overflow, order)
        seconds = time.perf_counter() - t0
        filled = np.add.reduceat(rows.length, rows.bounds[:-1]) if len(rows) else np.zeros(0)
        usable = len(filled) // MICRO_BATCH * MICRO_BATCH
        widths = [batch_width(int(b.max()), args.seq_len, "longest", PAD_MULTIPLE)
                  for b in filled[:usable].reshape(-1, MICRO_BATCH)]
        print(json.dumps({"bench": "data_layout", "samples": args.samples, "seq_len": args.seq_len,
                          "packing": packing, "overflow": overflow, "pack_order": order, "rows": len(rows),
                          "real_tokens": int(rows.length.sum()),
                          "packing_efficiency": round(float(rows.length.sum() / (len(rows) * args.seq_len)), 4),
                          "mean_width_pad_to_longest": round(float(np.mean(widths)), 1),
                          "layout_s": round(seconds, 2)}))


if __name__ == "__main__":
    main()
