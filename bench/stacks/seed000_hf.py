"""Seed 000's LoRA as an hf stack entry (docs/stacks/hf.md): TRL's SFTTrainer with PEFT's LoRA r64 / alpha 128 on
the attention and MLP projections (raybench's `attention_mlp`), on the sweep's model directory and the tokens
raybench tokenized for its own loop (ctx.tokenized_dataset()), which TRL packs its own way (SFTConfig packing,
set in the sweep). bench/sweeps/gpu-stack-hf.yaml runs it on Llama-3.2-1B, gpu-stack-hf-cpu.yaml on a tiny model.

The frozen base is loaded in the trial's compute dtype (bf16 under train.precision bf16), as raybench's own loop
holds a LoRA trial's base (train.lora.base_dtype auto); PEFT keeps the adapters in fp32 (autocast_adapter_dtype).
Llama-3.2-1B ties its output head to the embeddings: no adapter on lm_head, as in raybench's `attention_mlp`.
"""

from __future__ import annotations

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attention + MLP


def build_trainer(overrides: dict, ctx):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    base_dtype = torch.bfloat16 if ctx.config.train.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=base_dtype,
                                                 attn_implementation=ctx.config.model.attn_implementation)
    lora = LoraConfig(r=64, lora_alpha=128, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return SFTTrainer(model=model, args=ctx.args, train_dataset=ctx.tokenized_dataset(),
                      processing_class=ctx.load_tokenizer(), peft_config=lora)
