"""A small real filesystem to fill, for the tests of a full store: a tmpfs mounted by the test (root only),
unmounted afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str):
    """A tmpfs of `size` (mount's own units: 512k, 2m) at `mount`, made here; skips the test where it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs refused here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path) -> Path:
    """Write one file until the filesystem is full; returns it (delete it to free the space)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as err:
        assert err.errno == 28  # ENOSPC
    finally:
        os.close(fd)
    return filler
