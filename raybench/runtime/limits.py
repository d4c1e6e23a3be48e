"""Per-worker limits that turn a runaway trial into a row instead of a dead machine.

Host memory: `resources.memory_limit_gib` becomes RLIMIT_DATA on each worker process. RLIMIT_DATA (Linux
>= 4.7) counts the heap and private writable mappings, so it tracks what a rank really allocates, while
RLIMIT_AS would also count Ray's shared object-store mapping and reserved-but-unused address space. An
allocation past the cap fails inside the process (torch: "DefaultCPUAllocator: can't allocate memory",
Python: MemoryError) and the trial is classified oom; nothing else on the host is touched.

Past the cap every allocation fails, in every thread; one in a thread that cannot raise (Ray's, gloo's) ends
the process instead of failing the trial. A cap the process is already over would start that race with the
first allocation of any thread, so such a trial fails at once, in Python, with a MemoryError (oom) that says
by how much.
"""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

GIB = 2**30


def apply_memory_limit(gib: float | None, held_bytes: int = 0) -> None:
    """Cap this process's private memory at `gib` GiB (no-op for None) on top of `held_bytes` it keeps from
    earlier trials (a warm pool actor's caches: the cap is the trial's own); never raises the hard limit."""
    if gib is None:
        return
    soft = int(gib * GIB) + held_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    held_now_gib = proc_status_gib("VmData") or 0.0  # what RLIMIT_DATA counts: private writable mappings
    if held_now_gib * GIB >= soft:
        kept = f" + {held_bytes / GIB:.2f} GiB kept from earlier trials" if held_bytes else ""
        raise MemoryError(f"this worker process holds {held_now_gib:.2f} GiB of private memory before the trial "
                          f"starts, over its cap of {soft / GIB:.2f} GiB (resources.memory_limit_gib={gib:g}{kept}): "
                          "raise resources.memory_limit_gib")
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def proc_status_gib(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM, VmData, RssFile, ...) in GiB; None where absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def release_free_heap() -> None:
    """Hand the heap glibc keeps after frees back to the system (malloc_trim), so RSS is live memory only."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)

