"""`raybench rehearse SWEEP`: each configuration of a planned sweep rehearsed once, priced with its device's
calibration profile (else the shipped constants), and stored for `raybench estimate` and `best --predict`."""

from __future__ import annotations

from collections.abc import Iterator

from raybench.planning import calibration, uncertainty
from raybench.rehearse import rehearsal, step_time
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.results.profiles import load_profile


def device_calibration(store_path, device: str | None) -> Calibration:
    """The Calibration of `device` (a GPU name, or "cpu") from the store's profile, else the shipped constants
    (a GPU trial without a GPU name is priced by nothing, so by the shipped constants)."""
    found = load_profile(store_path, device) if device else None
    return Calibration.from_profile(found) if found else SHIPPED_CALIBRATION


def rehearse_trials(spec, trials: list, store_path: str, gpu: str | None = None, busbw: float | None = None,
                    full_depth: bool = False) -> Iterator[dict]:
    """One row per rehearsed configuration, yielded as each is done (a deep sweep takes minutes) and stored in
    the store's rehearsals. `gpu` and `busbw` override the sweep's estimate.gpu and estimate.busbw_gbps."""
    gpu = gpu or spec.estimate.gpu
    set_busbw = busbw or spec.estimate.busbw_gbps
    layout = None
    if spec.estimate.gpus_per_node or spec.estimate.nics_per_node:
        layout = step_time.layout_of(gpu, spec.estimate.gpus_per_node, spec.estimate.nics_per_node)
    seen, traced, priced = set(), {}, {}
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
        calibration.save_rehearsal(store_path, t.config_id, result)
        yield {"index": t.index, "trial_id": t.trial_id, "config_id": t.config_id, "axis_values": t.axis_values,
               "gpu": trial_gpu, **result,
               "intervals": uncertainty.rehearsal_intervals(result, t.assessment.analytic.params_total)}

