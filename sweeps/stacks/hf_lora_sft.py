"""An hf stack entry for seed 003's LoRA/QLoRA questions (sweeps/seed003-hf-lora.yaml and its CPU twin
sweeps/seed003-hf-lora-cpu.yaml): TRL's SFTTrainer with PEFT LoRA adapters on every linear layer of the decoder.

TRL loads the model itself from model.path (ctx.model_path), with SFTConfig's `model_init_kwargs` as
`from_pretrained`'s keyword arguments: the sweep sets them through stack.overrides.model_init_kwargs, so that one
axis holds LoRA (`{dtype: bfloat16}`: a bf16 base) and QLoRA (`quantization_config`: bitsandbytes' 4-bit NF4 base,
which TRL prepares for k-bit training). Everything else is the trial's SFTConfig as raybench built it (ctx.args:
optimizer, gradient checkpointing, batch, accumulation, loader workers, pin_memory) and the sweep's data tokenized
once by raybench (ctx.tokenized_dataset()), which TRL pads its own way.
"""

from __future__ import annotations

# Every linear layer of a Llama-architecture decoder block (the attention and MLP projections).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_trainer(overrides: dict, ctx):
    from peft import LoraConfig
    from trl import SFTTrainer

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM", target_modules=TARGETS)
    return SFTTrainer(model=ctx.model_path, args=ctx.args, train_dataset=ctx.tokenized_dataset(),
                      processing_class=ctx.load_tokenizer(), peft_config=lora)
