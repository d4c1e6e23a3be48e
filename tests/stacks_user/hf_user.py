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
