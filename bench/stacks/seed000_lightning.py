"""Seed 000's LoRA as a lightning stack entry (docs/stacks/lightning.md): a LightningModule holding the sweep's model
directory with PEFT's LoRA (r64 / alpha 128 on the attention and MLP projections, raybench's `attention_mlp`),
trained on the very rows and batches raybench's own loop builds (ctx.train_rows(), ctx.data_collator()).
bench/sweeps/gpu-stack-lightning.yaml runs it on Llama-3.2-1B, gpu-stack-lightning-cpu.yaml on a tiny model.

The frozen base is loaded in the trial's compute dtype (bf16 under train.precision bf16, Lightning's bf16-mixed
autocast around it), as raybench's own loop holds a LoRA trial's base (train.lora.base_dtype auto); PEFT keeps the
adapters in fp32. AdamW over the adapters only, at a constant learning rate without weight decay (raybench's
defaults), in torch's foreach implementation where the other two runs use the fused one (see configure_optimizers).
Llama-3.2-1B ties its output head to the embeddings: no adapter on lm_head.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attention + MLP


class LoraCausalLM(LightningModule):
    def __init__(self, model_path: str, attn_implementation: str, base_dtype: torch.dtype, rank: int, alpha: int,
                 lr: float):
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=base_dtype,
                                                    attn_implementation=attn_implementation)
        lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        adapters = [p for p in self.parameters() if p.requires_grad]
        # torch's default implementation (foreach on CUDA), not fused: Lightning's bf16-mixed refuses to clip
        # gradients (train.max_grad_norm, 1.0 as in the other two runs) for a fused optimizer, which unscales them
        # itself ("does not allow for gradient clipping").
        return torch.optim.AdamW(adapters, lr=self.lr, weight_decay=0.0)


def build(ctx, batch_size: int = 6, lr: float = 3e-4, rank: int = 64, alpha: int = 128, num_workers: int = 2,
          pin_memory: bool = True):
    config = ctx.config
    base_dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
    module = LoraCausalLM(config.model.path, config.model.attn_implementation, base_dtype, rank, alpha, lr)
    # drop_last: every optimizer step holds the same number of rows, as in raybench's loop.
    loader = DataLoader(ctx.train_rows(), batch_size=batch_size, drop_last=True, collate_fn=ctx.data_collator(),
                        num_workers=num_workers, pin_memory=pin_memory)
    return module, loader
