"""Rehearsals in the store (`raybench rehearse` writes them; `estimate`, `best --predict` and the plan's calibration
read them): `STORE/rehearsals/CONFIG_ID.json`, one per trial configuration, the latest kept."""

from __future__ import annotations

from pathlib import Path

from raybench.results.store import read_document, write_document

REHEARSALS_DIR = "rehearsals"


def rehearsal_path(store_path: str | Path, config_id: str) -> Path:
    return Path(store_path) / REHEARSALS_DIR / f"{config_id}.json"


def rehearsals(store_path: str | Path | None) -> dict[str, dict]:
    """{config_id: rehearsal} of every rehearsal stored in the store (see raybench/rehearse/)."""
    if store_path is None or not (Path(store_path) / REHEARSALS_DIR).is_dir():
        return {}
    return {p.stem: read_document(p) for p in sorted((Path(store_path) / REHEARSALS_DIR).glob("*.json"))
            if not p.name.startswith(".")}


def save_rehearsal(store_path: str | Path, config_id: str, rehearsal: dict) -> Path:
    return write_document(rehearsal_path(store_path, config_id), rehearsal)
