"""The hf stack's test entry: TRL's SFTTrainer on the trial's model and data, built with the trial's arguments."""


def build_trainer(overrides: dict, ctx):
    from trl import SFTTrainer

    return SFTTrainer(model=ctx.load_model(), args=ctx.args, train_dataset=ctx.load_dataset(),
                      processing_class=ctx.load_tokenizer())
