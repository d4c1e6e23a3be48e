"""Rehearse a trial at full scale in one CPU process: fake tensors, a fake process group, one traced step.

The trial's own worker path runs unchanged — meta build, techniques (`build.prepare_model`), the strategy's
wrap (`strategies.setup`), one step of `bench.train_step` — as rank 0 of the trial's full world, but the
model's storage comes from `to_empty` under a FakeTensorMode (shapes and dtypes, no bytes) and the process
group is torch's fake backend (every collective returns at once). A dispatch mode watching that step reports:
- peak tensor memory by category (torch's MemTracker / FSDPMemTracker),
- bytes per step by collective (each c10d or functional collective the step issues),
- FLOPs and bytes per operator, turned into a roofline step time with the hardware table's peak FLOP/s
  and memory bandwidth, and communication time from a bus bandwidth.
For fully checkpointed FSDP2 trials it also records one decoder block's operators with torch's SAC
estimator (timed by the same roofline), from which an op-level checkpointing policy is derived with torch's
SAC ILP.

Modules, each importing only those listed after it:
- `workers`: `raybench rehearse --jobs N`, the groups of configurations that share traces on N worker processes.
- `choice`: `raybench best SWEEP --predict`, the best value of an axis from the stored rehearsals.
- `trials`: `raybench rehearse SWEEP`, each configuration of a sweep rehearsed once, priced and stored, and the
  groups of them that share traces (beside `choice`: neither imports the other).
- `flips`: where that choice could flip inside the prediction intervals, and the sweep that settles it.
- `rehearsal`: one trial's rehearsal (`rehearse`), or its analytic fallback and why.
- `policy`: the op-level policy (torch's SAC estimator and ILP).
- `compiled`: what torch.compile's blocks keep for backward and the bytes their kernels move (inductor's
  partitioner, lowering and scheduler on one block).
- `step_time`: roofline compute plus communication (nominal links or a measured bus bandwidth).
- `trace`: the traced step (the strategy's wrap, one step under the step tracker, its `StepTrace`).
- `step_tracker`: torch's memory trackers with raybench's corrections, and the memory at each place of the step.
- `traced_model`: the trial as traced (its TrainSpec, the model with its techniques, batches, DDP's buckets).
- `step_costs`: every operator's roofline cost and every collective, part by part and in the order issued.
- `fake_world`: fake tensors and torch's fake process group, and what the trace counts in them.
- `roofline`: one operator's FLOPs and bytes, priced on a GPU of the hardware table.
- `fitted`: the constants fitted on GPU measurements, with where they come from, and the `Calibration` a
  device's profile (`raybench calibrate`) replaces them with.

This package is the one place that touches private torch APIs (torch.distributed._tools, the fake process
group, FakeTensorMode, DTensor's sharding propagator, the runtime-estimation op lists, inductor's partitioner
and scheduler): a torch upgrade that moves them breaks here, and tests/unit/test_rehearse.py pins each one.
docs/rehearse.md describes the method, what it cannot see, and its measured accuracy.
"""
