"""A rank's memory accounting: peak windows of host RSS and of CUDA's allocator, net of what the process held
before the trial (a warm pool actor's caches and earlier trials) and of the library code it faulted in."""

from __future__ import annotations

from pathlib import Path

import torch

from raybench.data import json_rows
from raybench.runtime import limits, weights
from raybench.runtime.rank_metrics import Peaks
from raybench.spec.schema import GIB

# Resident host memory when this process began its first trial (raybench imported, nothing else done yet).
_FIRST_TRIAL_RSS_GIB: float | None = None


def held_from_earlier_trials_gib() -> float:
    """Host memory this process holds from earlier trials (0 in a fresh process): in a warm pool actor the
    weights and tokenized-data caches, libraries earlier trials imported, the allocator's retained pages. Host
    peaks are reported net of it and the memory cap applies on top of it, so that a warm row says what a fresh
    process would (docs/executors.md)."""
    global _FIRST_TRIAL_RSS_GIB
    rss_gib = current_host_memory_gib()
    if _FIRST_TRIAL_RSS_GIB is None:
        _FIRST_TRIAL_RSS_GIB = rss_gib
    return max(0.0, rss_gib - _FIRST_TRIAL_RSS_GIB)


def cache_gib() -> float:
    """The weights and tokenized-data caches a warm pool actor keeps for later trials."""
    return (weights.STATE_CACHE.nbytes() + json_rows.memory_cache_bytes()) / GIB


def reset_peaks(device: torch.device) -> tuple[float, float]:
    """Start new peak-memory windows (host RSS, and CUDA's allocator on GPUs); returns the RSS and its
    file-backed part now, in GiB."""
    # Writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS on Linux. Without it the training peak
    # would be the process's (build and, in a warm actor, earlier trials included): fail rather than mislead.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak host memory counter ({err}): raybench workers need Linux with a "
                           "writable /proc/self/clear_refs") from None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return peak_host_memory_gib() or 0.0, limits.proc_status_gib("RssFile") or 0.0


def peaks(device: torch.device, held_gib: float, file_at_reset_gib: float, gpu_held_gib: float = 0.0) -> Peaks:
    """This rank's peaks since the last reset. Host: net of `held_gib` (kept from earlier trials) and of the
    file-backed pages first touched in the window: library code that a fresh process faults in when it first
    runs it and a warm actor has resident already. Those pages are the shared
    library file's, one copy per node however many ranks run it. GPU: net of `gpu_held_gib`, the tensors
    still allocated before this trial's build (what earlier trials of a warm actor left; 0 in a fresh process)."""
    on_gpu = device.type == "cuda"
    code_gib = max(0.0, (limits.proc_status_gib("RssFile") or 0.0) - file_at_reset_gib)
    return Peaks(rss_gib=(peak_host_memory_gib() or 0.0) - held_gib - code_gib,
                 alloc_gib=torch.cuda.max_memory_allocated(device) / GIB - gpu_held_gib if on_gpu else None,
                 reserved_gib=torch.cuda.max_memory_reserved(device) / GIB - gpu_held_gib if on_gpu else None)


def gpu_allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0.0


def peak_host_memory_gib() -> float | None:
    return limits.proc_status_gib("VmHWM")


def current_host_memory_gib() -> float:
    return limits.proc_status_gib("VmRSS") or 0.0


def memory_in_use() -> str:
    """The memory in use now, for an out-of-memory error's message."""
    host = f"host RSS peak {peak_host_memory_gib() or 0:.2f} GiB"
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return host
    device = torch.cuda.current_device()
    return (f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB reserved on GPU {device}, {host}")
