"""Calibration profiles in the store: `STORE/calibration/KEY.json`, one per device type (its hardware-table row,
"CPU" for a CPU), the latest calibration kept (`raybench calibrate` writes them; `rehearse` and `best --predict`
read them)."""

from __future__ import annotations

import re
from pathlib import Path

from raybench.results.store import read_document, write_document
from raybench.spec.hardware import find_gpu

CALIBRATION_DIR = "calibration"
CPU_KEY = "CPU"


def profile_key(device: str | None) -> str:
    """The key a device's profile is stored under: its hardware-table row ('H100 SXM', 'NVIDIA H100 80GB HBM3'
    and 'H100' share one), else its name as given; a CPU (None, 'cpu') is CPU_KEY."""
    if not device or device.lower() == "cpu":
        return CPU_KEY
    row = find_gpu(device)
    return row.label if row else device


def profile_path(store_path: str | Path, device: str | None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", profile_key(device)).strip("-")
    return Path(store_path) / CALIBRATION_DIR / f"{slug}.json"


def save_profile(store_path: str | Path, profile: dict) -> Path:
    """Write a profile (atomically, replacing the device type's earlier one); its fingerprint's key names it."""
    return write_document(profile_path(store_path, profile["fingerprint"]["key"]), profile, indent=1)


def load_profile(store_path: str | Path | None, device: str | None) -> dict | None:
    """The stored profile of `device` (a GPU name as --gpu or estimate.gpu spell it; None for a CPU), or None."""
    if store_path is None:
        return None
    path = profile_path(store_path, device)
    return read_document(path) if path.is_file() else None
