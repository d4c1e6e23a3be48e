"""A lightning stack entry (docs/stacks/lightning.md): a Llama-architecture LightningModule with random weights,
trained on random tokens. raybench calls `build(**overrides)` on every rank, with the overrides that are this
function's parameters (the rest are Lightning Trainer arguments), and builds the Trainer itself.

The shape parameters default to raybench's `tiny` preset; a sweep on a real model would load it instead
(AutoModelForCausalLM.from_pretrained) and bring its own DataLoader.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM


class CausalLM(LightningModule):
    def __init__(self, config: LlamaConfig, lr: float, gradient_checkpointing: bool):
        super().__init__()
        self.model = LlamaForCausalLM(config)  # random weights; the same on every rank (raybench seeds first)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class RandomTokens(Dataset):
    """`samples` sequences of `seq_len` random token ids; labels are the inputs (the model shifts them)."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int):
        self.ids = torch.randint(0, vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(batch_size: int = 2, seq_len: int = 128, samples: int = 1024, lr: float = 1e-3,
          gradient_checkpointing: bool = False, hidden_size: int = 128, num_hidden_layers: int = 4,
          num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 256,
          vocab_size: int = 2000, attn_implementation: str = "sdpa"):
    config = LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                         intermediate_size=intermediate_size, vocab_size=vocab_size,
                         max_position_embeddings=max(seq_len, 2048), attn_implementation=attn_implementation)
    module = CausalLM(config, lr, gradient_checkpointing)
    # Lightning gives each rank its own part of the data (use_distributed_sampler); drop_last keeps every
    # micro-batch the same size, so every optimizer step holds the same tokens.
    return module, DataLoader(RandomTokens(samples, seq_len, vocab_size), batch_size=batch_size, shuffle=True,
                              drop_last=True)
