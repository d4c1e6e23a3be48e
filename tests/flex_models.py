"""What the flex-attention tests share (tests/unit/test_flex_attention.py on CPU,
tests/gpu/test_gpu_flex_attention.py on CUDA): packed micro-batches as the loader builds them, and a two-layer
Llama with a chosen attention kernel."""

from __future__ import annotations

import copy

import torch

from raybench.runtime.data import collate_rows


def packed_batch(samples: list[list[int]], seq_len: int, varlen: bool = False) -> dict:
    """Rows packed from samples of these lengths (seeded random token ids), as runtime.data.collate_rows builds
    them."""
    gen = torch.Generator().manual_seed(0)
    rows = [[(torch.randint(4, 128, (n,), generator=gen).numpy(), None) for n in row] for row in samples]
    batch = collate_rows(rows, seq_len, pad_id=0, packing=True, varlen=varlen)
    batch.pop("nonpad_tokens")
    return batch


def tiny_llama(attn: str, hidden: int, max_positions: int):
    """A seeded two-layer Llama of width `hidden` over a 128-token vocabulary, attending with `attn`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=max_positions)
    # _from_config sets the implementation on the config it is given: each model gets its own copy.
    return LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn)
