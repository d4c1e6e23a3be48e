"""The hf stack's test entries, each built with the trial's arguments: TRL's SFTTrainer on the trial's model and
data.path's records; a plain transformers Trainer on raybench's own rows and collator (the batches raybench's loop
trains on)."""


def build_trainer(overrides: dict, ctx):
    from trl import SFTTrainer

    return SFTTrainer(model=ctx.load_model(), args=ctx.args, train_dataset=ctx.load_dataset(),
                      processing_class=ctx.load_tokenizer())


def build_plain_trainer(overrides: dict, ctx):
    from transformers import Trainer

    return Trainer(model=ctx.load_model(), args=ctx.args, train_dataset=ctx.train_rows(),
                   data_collator=ctx.data_collator())


def build_checkpointed_trainer(overrides: dict, ctx):
    """build_plain_trainer, but the entry checkpoints the model's layers itself, whatever train.ac_ratio says."""
    from transformers import Trainer

    model = ctx.load_model()
    # transformers 5.23 renamed gradient_checkpointing_enable (kept as a deprecated alias)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return Trainer(model=model, args=ctx.args, train_dataset=ctx.train_rows(), data_collator=ctx.data_collator())
