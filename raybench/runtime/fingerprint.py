"""Hardware and software provenance recorded with every result row.

Environment variables are captured only from an allow-list of prefixes, and any name that looks like a
secret is dropped even when its prefix is allowed.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

from raybench.spec.redact import ANSI_ESCAPE, SECRET_PATTERN

# RAYBENCH_CUDA_MEMORY_SNAPSHOT: a recorded trial's timings include the recording (cuda_snapshot).
ENV_ALLOWED_PREFIXES = ("NCCL_", "CUDA_", "OMP_", "TORCH_", "TORCHINDUCTOR_", "MKL_", "MALLOC_", "SLURM_JOB_ID",
                        "SLURM_NODELIST", "RAYBENCH_CUDA_MEMORY_SNAPSHOT")
PACKAGES = ("torch", "ray", "transformers", "peft", "deepspeed", "raybench")
NVML_MISSING = ("pynvml is not installed: the GPU clock, power-limit, driver and topology fields stay empty. "
                "Install the gpu extra (pip install 'raybench[gpu]', which brings nvidia-ml-py).")
log = logging.getLogger(__name__)


def captured_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {
        k: v for k, v in sorted(environ.items())
        if k.startswith(ENV_ALLOWED_PREFIXES) and not SECRET_PATTERN.search(k)
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@cache
def git_sha() -> str | None:
    """The commit of the raybench source tree when it runs from a git checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def system_label(environ: dict[str, str] | None = None) -> str:
    """The name results are grouped and compared by: RAYBENCH_SYSTEM, else the SLURM cluster, else the host.

    Rows of one cluster share it whichever node ran them, so `raybench compare` can set sites side by side.
    """
    environ = os.environ if environ is None else environ
    return environ.get("RAYBENCH_SYSTEM") or environ.get("SLURM_CLUSTER_NAME") or socket.gethostname()


def filesystem_of(path: str | Path) -> str | None:
    """Filesystem type of the mount holding `path` (longest mount-point prefix in /proc/mounts)."""
    target = str(Path(path).resolve())
    best, fstype = "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fstype = mount, kind
    except OSError:
        return None
    return fstype


def nvml_details(device_index: int) -> dict:
    """Clocks, power limit, driver and topology from NVML / nvidia-smi; empty, with a warning, without pynvml."""
    try:
        import pynvml
    except ImportError:
        warn_nvml_missing()
        return {}
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        details = {
            "gpu_mem_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "gpu_sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "gpu_power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000,
            "gpu_driver_version": pynvml.nvmlSystemGetDriverVersion(),
        }
    finally:
        pynvml.nvmlShutdown()
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
        details["gpu_topology"] = ANSI_ESCAPE.sub("", topo).strip()[:4000] or None  # it underlines its header
    except (OSError, subprocess.TimeoutExpired):
        pass
    return details


@cache
def warn_nvml_missing() -> None:
    """Once per process: a warm pool actor fingerprints every trial it serves."""
    log.warning(NVML_MISSING)


@cache
def software() -> dict:
    """Versions never change inside a process: looked up once (a warm pool actor serves many trials)."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    row = {f"{name}_version": package_version(name) for name in PACKAGES}
    row.update(python_version=platform.python_version(), cuda_version=torch.version.cuda, nccl_version=nccl,
               git_sha=git_sha())
    return row


def hardware(device) -> dict:
    import torch

    gpu = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if gpu else None
    return {
        "device_type": device.type,
        "gpu_name": props.name if gpu else None,
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "gpu_memory_gib": props.total_memory / 2**30 if gpu else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "ram_gib": ram_gib(),
        "hostname": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "platform": f"{platform.system()} {platform.release()} {sys.implementation.name}",
        **(nvml_details(device.index or 0) if gpu else {}),
    }
