"""Utilization over a trial's timed window: this rank's CPU use, and on GPU the device's utilization, power
and clocks through NVML (when installed).

Samples are taken between steps (`tick`, at most one per interval_s) rather than by a background thread: on a
busy host a sampling thread competes with the ranks for cores and measurably slowed the loop it watched.
"""

from __future__ import annotations

import logging
import statistics
import time

import psutil

from raybench.runtime import fingerprint

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, gpu_index: int | None, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first reading only starts psutil's interval
        self._last = time.perf_counter()
        self._nvml = self._gpu_handle(gpu_index)

    @staticmethod
    def _gpu_handle(gpu_index: int | None):
        if gpu_index is None:
            return None
        try:
            import pynvml
        except ImportError:
            fingerprint.warn_nvml_missing()
            return None
        try:
            pynvml.nvmlInit()
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        except pynvml.NVMLError as err:  # no driver or no such device: sample the CPU only, and say so
            log.warning("NVML is unusable (%s): the GPU utilization, power and clock samples stay empty", err)
            return None

    def tick(self) -> None:
        """Take a sample if interval_s has passed since the last one."""
        now = time.perf_counter()
        if now - self._last < self.interval_s:
            return
        self._last = now
        values = {"cpu_util_pct": self._process.cpu_percent(None)}
        if self._nvml:
            nvml, handle = self._nvml
            values.update(
                gpu_util_pct=nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                gpu_power_w=nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                gpu_sm_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                gpu_mem_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            )
        self.samples.append((now, values))

    def close(self) -> None:
        if self._nvml:
            self._nvml[0].nvmlShutdown()

    def means(self, since: float) -> dict[str, float]:
        """Mean of each sampled quantity over samples taken at or after perf_counter() time `since`.

        A sample describes the interval before it, so the first one inside the window may include warm-up:
        it is dropped when later samples exist.
        """
        window = [values for t, values in self.samples if t >= since]
        if len(window) > 1:
            window = window[1:]
        if not window:
            return {}
        return {key: statistics.fmean(v[key] for v in window) for key in window[0]}
