"""sdpa forward and backward at Llama-3.2-1B's attention shape (32 query heads, 8 key/value heads, head dim 64, bf16):
one flattened row of micro_batch x seq_len tokens under a block-diagonal causal mask (TRL's padding-free row as sdpa
takes it: one dense square mask over the whole row) against micro_batch rows of seq_len under per-row masks (raybench's
packed rows), the same documents (DOC tokens each: the round's chats average 32.7). The flattened row's attention is
the full square of its tokens, micro_batch times the rows' work: this measures what that costs a step per layer.

    python3 bench/packed_row_attention.py [--device cuda] [--seq-len 2048] [--micro-batch 6] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, DOC = 32, 8, 64, 33


def block_causal_mask(tokens: int, device: torch.device) -> torch.Tensor:
    """Each token attends to the earlier tokens of its own document."""
    document = torch.arange(tokens, device=device) // DOC
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    return causal & (document[:, None] == document[None, :])


def seconds(rows: int, tokens: int, mask: torch.Tensor, device: torch.device, reps: int) -> float:
    """The fastest of `reps` forward-and-backward passes (after one untimed)."""
    q = torch.randn(rows, HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, device=device, requires_grad=True)
    k, v = (torch.randn(rows, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, device=device, requires_grad=True)
            for _ in range(2))
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device, length, batch = torch.device(args.device), args.seq_len, args.micro_batch
    flat = seconds(1, batch * length, block_causal_mask(batch * length, device)[None, None], device, args.reps)
    rows = seconds(batch, length, block_causal_mask(length, device)[None, None].expand(batch, 1, length, length),
                   device, args.reps)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: sdpa forward+backward, one layer: one flattened row of {batch * length} tokens {flat * 1e3:.1f} ms, "
          f"{batch} rows of {length} {rows * 1e3:.1f} ms: {flat / rows:.2f}x")


if __name__ == "__main__":
    main()
