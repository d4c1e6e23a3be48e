"""Model weights close to the ranks: one node-local copy per node, one in-memory copy per warm pool actor.

A model directory on a shared filesystem (NFS, Lustre, GPFS) is read by every rank of every trial; on a busy
cluster that read dominates a short trial's setup. The first rank on a node copies the directory to node-local
disk (RAYBENCH_LOCAL_DIR, else the job's SLURM_TMPDIR/TMPDIR, else /tmp); later ranks and trials on that node
load the copy, which then lives in the page cache all of them share. Copies are addressed by content (sha256 of
every file), so a changed model is never confused with an old copy, and identical models are copied once.

Warm pool actors also keep the last models they loaded in memory (a state dict on the host, keyed by content
hash or, for presets, by the random-init seed), within `pool.weights_cache_gib`, so that a trial on the same
model skips reading and initialising its weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from raybench.runtime.fingerprint import filesystem_of

# Filesystems whose reads cross the network: `model.local_copy: auto` copies weights off them.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.sshfs", "panfs",
                       "wekafs", "9p")
CHUNK_BYTES = 16 * 2**20
COMPLETE = ".raybench-complete"  # written last: a copy without it was interrupted and is redone


def local_root() -> Path:
    base = os.environ.get("RAYBENCH_LOCAL_DIR") or os.environ.get("SLURM_TMPDIR") or tempfile.gettempdir()
    return Path(base) / f"raybench-{os.getuid()}"


def wants_copy(path: str, mode: str) -> bool:
    """Whether `model.local_copy` (auto | always | never) asks for a node-local copy of `path`."""
    if mode == "auto":
        return (filesystem_of(path) or "") in NETWORK_FILESYSTEMS
    return mode == "always"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE)


def _source_key(directory: Path) -> str:
    """Cheap identity of a source directory (names, sizes, mtimes) to find its content hash without reading it."""
    h = hashlib.sha256()
    for p in _files(directory):
        st = p.stat()
        h.update(f"{p.relative_to(directory)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def content_hash(directory: Path) -> str:
    """sha256 over every file's relative name and bytes."""
    h = hashlib.sha256()
    for p in _files(directory):
        h.update(f"{p.relative_to(directory)}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()[:24]


def node_local_copy(source: str, root: Path | None = None) -> tuple[Path, bool]:
    """(path of this node's copy of the model directory `source`, whether this call made it).

    One process per node copies (a file lock serialises ranks starting together). The copy is made in a
    temporary directory, hashed there (a local read, not a second one over the network) and renamed into place,
    so a killed copy never looks complete.
    """
    src = Path(source).resolve()
    root = root or local_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    by_source = root / "by-source" / _source_key(src)  # source identity -> content-addressed copy
    with open(root / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (by_source / COMPLETE).is_file():
            return by_source.resolve(), False
        tmp = Path(tempfile.mkdtemp(prefix=".copy-", dir=root))
        try:
            shutil.copytree(src, tmp / "model")
            digest = content_hash(tmp / "model")
            dest = root / "weights" / digest
            made = not (dest / COMPLETE).is_file()
            if made:  # else: the same content was copied before from another path
                shutil.rmtree(dest, ignore_errors=True)
                (tmp / "model" / COMPLETE).write_text(digest)
                dest.parent.mkdir(exist_ok=True)
                os.replace(tmp / "model", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        by_source.parent.mkdir(exist_ok=True)
        by_source.unlink(missing_ok=True)
        by_source.symlink_to(dest)
    return dest, made


_HASHES: dict[str, str] = {}  # source identity -> content hash, so a warm actor reads a directory's bytes once


def model_key(path: Path) -> str:
    """Content hash of a node-local copy (stored with it), or of any other directory (computed once per
    process while its files keep their names, sizes and mtimes)."""
    marker = path / COMPLETE
    if marker.is_file():
        return marker.read_text()
    identity = _source_key(path)
    if identity not in _HASHES:
        _HASHES[identity] = content_hash(path)
    return _HASHES[identity]


class StateCache:
    """Host copies of loaded weights, most recently used kept, within a byte budget."""

    def __init__(self):
        self.entries: OrderedDict[str, dict] = OrderedDict()

    def get(self, key: str) -> dict | None:
        state = self.entries.get(key)
        if state is not None:
            self.entries.move_to_end(key)
        return state

    def put(self, key: str, state: dict, budget_bytes: int) -> None:
        if _state_bytes(state) > budget_bytes:
            return
        self.entries[key] = state
        while self.nbytes() > budget_bytes:
            self.entries.popitem(last=False)

    def nbytes(self) -> int:
        return sum(_state_bytes(state) for state in self.entries.values())


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


STATE_CACHE = StateCache()  # per process: only warm pool actors live long enough to hit it
