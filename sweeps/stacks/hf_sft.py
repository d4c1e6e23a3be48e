"""An hf stack entry (docs/stacks/hf.md): TRL's SFTTrainer with LoRA adapters from PEFT, on the trial's model
and data. raybench calls `build_trainer(overrides, ctx)` on every rank; ctx.args is the trial's SFTConfig (the
overrides and raybench's mapped train fields already in it): pass it to the trainer as it is. The data is the
sweep's own, tokenized once by raybench (ctx.tokenized_dataset()): the tokens raybench's loop trains on, which TRL
then pads or packs its own way; the row records which data it was."""

from __future__ import annotations


def build_trainer(overrides: dict, ctx):
    from peft import LoraConfig
    from trl import SFTTrainer

    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return SFTTrainer(model=ctx.load_model(), args=ctx.args, train_dataset=ctx.tokenized_dataset(),
                      processing_class=ctx.load_tokenizer(), peft_config=lora)
