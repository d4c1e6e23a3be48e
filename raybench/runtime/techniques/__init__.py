"""Model techniques. Each module has the same two functions:

    wanted(train: TrainSpec) -> bool            does this trial ask for it?
    apply(model, train: TrainSpec) -> model     apply it (in place where it can), return the model

`build.TECHNIQUES` fixes the order they are applied in. Techniques import neither each other nor the
strategies or executors.
"""
