"""`raybench rehearse SWEEP`: each configuration of a planned sweep rehearsed once, priced with its device's
calibration profile (else the shipped constants), and stored for `raybench estimate` and `best --predict`; and
the groups of configurations that share traces (what `raybench rehearse --jobs N` gives each worker process)."""

from __future__ import annotations

from collections.abc import Iterator

from raybench.planning import calibration, uncertainty
from raybench.planning.plan import config_id
from raybench.rehearse import rehearsal, step_time
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.results import rehearsals
from raybench.results.profiles import load_profile


def device_calibration(store_path, device: str | None) -> Calibration:
    """The Calibration of `device` (a GPU name, or "cpu") from the store's profile, else the shipped constants
    (a GPU trial without a GPU name is priced by nothing, so by the shipped constants)."""
    found = load_profile(store_path, device) if device else None
    return Calibration.from_profile(found) if found else SHIPPED_CALIBRATION


def rehearse_trials(spec, trials: list, store_path: str, gpu: str | None = None, busbw: float | None = None,
                    full_depth: bool = False, traces: dict | None = None) -> Iterator[dict]:
    """One row per rehearsed configuration, yielded as each is done (a deep sweep takes minutes) and stored in
    the store's rehearsals. `gpu` and `busbw` override the sweep's estimate.gpu and estimate.busbw_gbps.
    `traces`: the trace cache to use (a worker process keeps one across the groups it is given), else a new one."""
    gpu = gpu or spec.estimate.gpu
    set_busbw = busbw or spec.estimate.busbw_gbps
    layout = None
    if spec.estimate.gpus_per_node or spec.estimate.nics_per_node:
        layout = step_time.layout_of(gpu, spec.estimate.gpus_per_node, spec.estimate.nics_per_node)
    seen, priced = set(), {}
    traced = {} if traces is None else traces
    for t in trials:
        if t.config_id in seen:  # repeats of one configuration rehearse once
            continue
        seen.add(t.config_id)
        on_gpu = t.config.resources.gpus_per_worker > 0
        trial_gpu = gpu if on_gpu else None
        trial_busbw, source = set_busbw, "set"
        if not trial_busbw:
            trial_busbw, source = calibration.probe_busbw_gbps(store_path, t.world_size, trial_gpu), "probe"
        device = trial_gpu if on_gpu else "cpu"
        if device not in priced:  # the store's calibration profile of the device, else the shipped constants
            priced[device] = device_calibration(store_path, device)
        # Configurations that trace the same step (compiled and eager twins: compile is traced eager) trace once.
        result = rehearsal.rehearse(t.config, t.shape, trial_gpu, trial_busbw, source, analytic=t.assessment.analytic,
                                    calibration=priced[device], traces=traced, extrapolate_depth=not full_depth,
                                    layout=layout).as_dict()
        rehearsals.save_rehearsal(store_path, t.config_id, result)
        yield {"index": t.index, "trial_id": t.trial_id, "config_id": t.config_id, "axis_values": t.axis_values,
               "gpu": trial_gpu, **result,
               "intervals": uncertainty.rehearsal_intervals(result, t.assessment.analytic.params_total)}


def shared_keys(trial, gpu: str | None) -> list[tuple]:
    """The keys under which the rehearsal's `traces` cache may hold what this trial shares with others, made by
    rehearsal's own functions: the step it traces (`rehearsal.step_config`: compiled traced eager, a DDP world
    of 2 ranks or more as 2; a ZeRO trial its FSDP2 twin's) with the sAC ratio at 0, as the shallow models of a
    deep model are keyed (every ratio shares them), the same step at any world size where FSDP2 shards it
    (`rehearsal.any_world`: a step's world sizes share it, worlds.py), and one block's operators
    (`rehearsal.block_ops_key`: every world size and accumulation count) where an op-level policy starts from the
    trial. Keyed more coarsely than
    the cache (a shallow model's ratios go together even where the whole model is traced), never more finely."""
    config = rehearsal.zero_twin(trial.config) or trial.config
    base = config.model_copy(update={"train": config.train.model_copy(update={"ac_ratio": "0"})})
    keys = [("step", config_id(rehearsal.step_config(base)))]
    if config.train.fsdp2_sharded:  # its world sizes share their steps once two are traced (worlds.py)
        keys.append(("any world", config_id(rehearsal.any_world(base))))
    if gpu and config.resources.gpus_per_worker > 0 and rehearsal.is_policy_base(config):
        # The calibration's source is one per device in a sweep, so the shipped constants' key groups alike.
        keys.append(rehearsal.block_ops_key(config, gpu, SHIPPED_CALIBRATION))
    return keys


def trace_groups(trials: list, gpu: str | None) -> list[list]:
    """The trials (one per configuration) in groups that share no trace with another group: trials sharing any
    key of `shared_keys` go together, and so on transitively. Groups in the order of their first trial, each
    in the order of `trials`."""
    joined_to = list(range(len(trials)))  # a forest of trial positions: each group's trials under one root

    def root(i: int) -> int:
        while joined_to[i] != i:
            i = joined_to[i]
        return i

    first_with_key: dict[tuple, int] = {}
    for i, t in enumerate(trials):
        for key in shared_keys(t, gpu):
            joined_to[root(i)] = root(first_with_key.setdefault(key, i))
    groups: dict[int, list] = {}
    for i, t in enumerate(trials):
        groups.setdefault(root(i), []).append(t)
    return list(groups.values())
