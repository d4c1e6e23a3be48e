"""Calibration profiles in the store: `STORE/calibration/KEY.json`, one per device type (its hardware-table row,
"CPU" for a CPU), the latest calibration kept (`raybench calibrate` writes them; `rehearse` and `best --predict`
read them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
    path = profile_path(store_path, profile["fingerprint"]["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_profile(store_path: str | Path | None, device: str | None) -> dict | None:
    """The stored profile of `device` (a GPU name as --gpu or estimate.gpu spell it; None for a CPU), or None."""
    if store_path is None:
        return None
    path = profile_path(store_path, device)
    return json.loads(path.read_text()) if path.is_file() else None
