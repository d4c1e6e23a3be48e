"""A user's Lightning project, as the lightning stack's tests run it: a tiny Llama from a model directory and a
map-style dataset of fixed-length token sequences, each with `pad_tokens` padding positions at its end (masked out
of attention and loss), so that a step's tokens and non-padding tokens are known exactly; or, with `ctx`, raybench's
own rows and collator over the trial's data spec (the batches raybench's loop trains on)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM


class CausalLM(LightningModule):
    def __init__(self, model_path: str, lr: float):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()  # from_pretrained returns it in eval mode
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class PaddedTokens(Dataset):
    """`samples` sequences of `seq_len` token ids, the last `pad_tokens` of each padding."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, pad_tokens: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        self.mask = torch.ones(samples, seq_len, dtype=torch.long)
        if pad_tokens:
            self.mask[:, -pad_tokens:] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def build(model_path: str, batch_size: int = 2, seq_len: int = 32, samples: int = 64, pad_tokens: int = 0,
          lr: float = 1e-3):
    module = CausalLM(model_path, lr)
    data = PaddedTokens(samples, seq_len, module.model.config.vocab_size, pad_tokens)
    return module, DataLoader(data, batch_size=batch_size, shuffle=True)


class StrictCausalLM(CausalLM):
    """CausalLM that refuses a batch holding anything but model inputs: what reaches training_step is the model's."""

    INPUTS = {"input_ids", "labels", "attention_mask", "position_ids"}

    def training_step(self, batch, batch_idx):
        if set(batch) - self.INPUTS:
            raise ValueError(f"training_step got more than model inputs: {sorted(set(batch) - self.INPUTS)}")
        return super().training_step(batch, batch_idx)


def build_from_rows(model_path: str, ctx, batch_size: int = 2, lr: float = 1e-3):
    module = StrictCausalLM(model_path, lr)
    return module, DataLoader(ctx.train_rows(), batch_size=batch_size, shuffle=True, collate_fn=ctx.data_collator())
