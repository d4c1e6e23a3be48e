"""`raybench best SWEEP --predict`: the value of an axis (the sAC ratio by default) whose stored rehearsal fits in
device memory with the highest predicted tokens/s per GPU, per group of planned trials, whether that choice could
flip inside the prediction intervals, and the op-level policy torch's SAC ILP picks for the same memory
(raybench.reports.prediction prints them)."""

from __future__ import annotations

import dataclasses

from raybench.planning import uncertainty
from raybench.rehearse import flips, policy, rehearsal
from raybench.rehearse.fitted import Calibration


def predicted_tok_per_s_per_device(trial) -> float | None:
    """Tokens per second per GPU the rehearsal predicts: the step's tokens on one rank over its step time."""
    step_s = trial.assessment.rehearsed_step_time_s if trial.assessment else None
    return _tokens(trial) / step_s if step_s else None


def _tokens(trial) -> float:
    """Tokens one GPU's step trains on (a TP group shares its tokens)."""
    train = trial.config.train
    return train.micro_batch * train.seq_len * train.grad_accum / train.tp_size


def _value(trial, axis: str) -> dict:
    """One value of a group: the rehearsal's figures with their intervals, and the bands those are drawn with."""
    judged = trial.assessment
    return {"value": axis_value(trial.axis_values, axis), "axis_values": trial.axis_values,
            "peak_gib": judged.rehearsed_peak_gib, "peak_interval_gib": judged.peak_interval_gib,
            "fits": judged.fits, "tok_per_s_per_device": predicted_tok_per_s_per_device(trial),
            "tok_interval": uncertainty.reciprocal(judged.step_time_interval_s, _tokens(trial)),
            "band": dataclasses.asdict(judged.band), "compute_s": judged.rehearsed_compute_s or 0.0}


def axis_value(axis_values: dict, axis: str):
    """A trial's value of `axis`: one config field, or several comma-separated ones that vary together (a bundle
    such as {strategy: tp_fsdp2, tp_size: 2} against {strategy: fsdp2}), as their values joined by '/'; a field
    a point leaves at its default shows as '-'."""
    fields = axis.split(",")
    if len(fields) == 1:
        return axis_values.get(axis)
    return "/".join(str(axis_values.get(field, "-")) for field in fields)


def predicted_best(trials: list, axis: str = "train.ac_ratio", rehearsals: dict | None = None) -> list[dict]:
    """Per group of planned trials that differ only in `axis` (one config field, or several comma-separated): the
    value whose rehearsal fits in device memory
    with the highest predicted tokens/s per GPU (None when no rehearsed value fits), every value's figures with
    their intervals, and "in_doubt": the values the choice may flip between inside those intervals ([] when it
    stands; flips.in_doubt).

    With the stored rehearsals ({config_id: rehearsal}), each group also gets "op_policy": the op-level
    checkpointing policy torch's ILP picks within the same memory limit (see `group_op_policy`)."""
    groups: dict[tuple, list] = {}
    seen = set()
    for t in trials:
        if t.assessment and t.assessment.peak_basis == "rehearsed" and t.config_id not in seen:
            seen.add(t.config_id)  # repeats of a configuration are one value
            key = tuple((k, str(v)) for k, v in t.axis_values.items() if k not in axis.split(","))
            groups.setdefault(key, []).append(t)
    results = []
    for key, members in groups.items():
        values = [_value(t, axis) for t in members]
        fitting = [v for v in values if v["fits"] and v["tok_per_s_per_device"]]
        # Communication-bound steps predict equal times whatever is recomputed (it hides behind the collectives):
        # among equals, the least compute (the least recomputation) wins.
        best = max(fitting, key=lambda v: (round(v["tok_per_s_per_device"], 6), -v["compute_s"])) if fitting else None
        first = members[0].assessment
        results.append({"group": dict(key), "best": best, "values": values, "memory_gib": first.memory_gib,
                        "margin_gib": first.margin_gib, "in_doubt": flips.in_doubt(values, first.limit_gib),
                        "op_policy": group_op_policy(members, rehearsals) if rehearsals is not None else None})
    return results


def group_op_policy(members: list, rehearsals: dict) -> dict:
    """The op-level policy for a group, from its member with every block checkpointed whole (the policy's
    starting point, whose rehearsal holds one block's operators): {"policy": OpPolicy as a dict or None when
    nothing fits, "peak_gib": reserved + CUDA context, "tok_per_s_per_device"}, or {"why": ...} without one."""
    base = next((t for t in members if rehearsal.is_policy_base(t.config)), None)
    full_ac = rehearsals.get(base.config_id) if base else None
    if full_ac is None or not full_ac.get("block_ops"):
        return {"why": "needs the rehearsal of the group's ac_ratio 1 (block mode) FSDP2 GPU trial"}
    judged, train = base.assessment, base.config.train
    context_gib = judged.analytic.other_gib  # the CUDA context: outside what the allocator reserves
    limit = judged.limit_gib - context_gib  # what the allocator may reserve
    chosen = policy.op_policy(full_ac, base.shape.num_hidden_layers, limit)
    if chosen is None:
        return {"policy": None}
    if train.compile:  # the policy's base is an FSDP2 trial, whose compiled blocks the rehearsal inspects
        chosen = policy.compiled_policy(chosen, base.config, base.shape, Calibration.of(full_ac))
    tokens = train.micro_batch * train.seq_len * train.grad_accum / train.tp_size
    return {"policy": chosen.as_dict(), "peak_gib": chosen.reserved_gib + context_gib,
            "tok_per_s_per_device": tokens / chosen.step_time_s}

