"""NCCL's own word on how a trial's ranks talk: which transport each of its communicators' channels chose
(NVLink or PCIe peer-to-peer, shared memory, InfiniBand/RoCE, sockets), read from NCCL's INFO log, and whether
that is a fallback. A collective on a fallback transport (sockets between nodes, the network or shared memory
inside one) runs at a fraction of the link's speed, silently: every comparison of trials that ran on it is wrong.

A rank that starts NCCL sets NCCL_DEBUG=INFO for the INIT and NET subsystems only, written to a file of its own
(NCCL_DEBUG_FILE), not to the logs: a few lines per channel and communicator. A user who set NCCL_DEBUG_FILE keeps
their own; the row then says the transports were not checked. CPU trials (gloo) say "not checked (gloo)".
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import tempfile
from pathlib import Path

# "host:pid:tid [dev] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read" (and "[send] via NET/IB/0").
_CHANNEL = re.compile(r"NCCL INFO Channel \d+/\d+ : \d+\[\d+\] -> \d+\[\d+\](?: \[\w+\])? via (\S+(?: pointer)?)")
# "NCCL INFO comm 0x55cd... rank 1 nRanks 2 nNodes 1 localRanks 2 localRank 1 MNNVL 0"
_COMM = re.compile(r"NCCL INFO comm 0x[0-9a-f]+ rank \d+ nRanks \d+ nNodes (\d+)")
_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
# What usually makes NCCL fall back, by fallback: the environment variables to look at first.
CAUSES = {
    "sockets between nodes": ("NCCL_IB_DISABLE", "NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"),
    "the network inside one node": ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_LEVEL"),
    "shared memory inside one node": ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "CUDA_VISIBLE_DEVICES"),
}
_FILE: dict[str, object] = {}  # this process's log file and how far earlier trials read it


def capture() -> None:
    """Have NCCL log its transport choices to a file of this process's, from here on; call before NCCL starts
    (a process's first process group). A warm process calls it again for each trial: only what NCCL writes after
    the call is that trial's."""
    if "path" not in _FILE:
        if os.environ.get("NCCL_DEBUG_FILE"):  # the user's own NCCL log: theirs to read
            _FILE["path"] = None
            return
        directory = Path(tempfile.gettempdir()) / "raybench-nccl"
        directory.mkdir(exist_ok=True)
        path = directory / f"nccl-{os.getpid()}.log"
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
        atexit.register(_remove, path)
        _FILE["path"] = path
    path = _FILE["path"]
    _FILE["offset"] = path.stat().st_size if path and path.exists() else 0


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def log_path() -> Path | None:
    """This process's NCCL log file (None: not captured, or the user's own)."""
    return _FILE.get("path")


def logged() -> str | None:
    """What NCCL wrote since this trial's `capture`; None when it was not captured (the user's NCCL_DEBUG_FILE)."""
    path = _FILE.get("path")
    if path is None:
        return None
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        f.seek(_FILE.get("offset", 0))
        return f.read()
    return ""


def transports(log: str) -> dict:
    """The transports of a log's channels (kind/detail: "P2P/CUMEM", "SHM/direct", "NET/IB", "NET/Socket"), the
    most nodes any of its communicators spans, and the network NCCL chose."""
    kinds = {"/".join(via.split("/")[:2]) for via in _CHANNEL.findall(log)}
    nodes = [int(n) for n in _COMM.findall(log)]
    networks = _NETWORK.findall(log)
    return {"transports": sorted(kinds), "max_nodes": max(nodes, default=None),
            "network": networks[-1] if networks else None}


def merged(per_rank: list[dict]) -> dict:
    """Every rank's `transports` as one."""
    nodes = [r["max_nodes"] for r in per_rank if r["max_nodes"] is not None]
    networks = sorted({r["network"] for r in per_rank if r["network"]})
    return {"transports": sorted({t for r in per_rank for t in r["transports"]}),
            "max_nodes": max(nodes, default=None), "network": ", ".join(networks) or None}


def fallbacks(found: dict, hosts: int) -> list[str]:
    """The fallbacks in `found` (a `merged` result; `hosts`: how many hosts the trial's ranks ran on, for logs
    without NCCL's per-communicator line)."""
    kinds = {t.split("/")[0] for t in found["transports"]}
    multi_node = (found["max_nodes"] or hosts) > 1
    out = []
    if "NET/Socket" in found["transports"] and multi_node:
        out.append("sockets between nodes")
    if "NET" in kinds and not multi_node:
        out.append("the network inside one node")
    if "SHM" in kinds:
        out.append("shared memory inside one node")
    return out


def check_text(found: dict | None, hosts: int, environ: dict | None = None) -> str:
    """The row's verdict: "ok", "fallback: WHAT (usual causes: VARS; set here: VAR=VALUE)" or why not checked."""
    if found is None:
        return "not checked (NCCL_DEBUG_FILE set by the user)"
    if not found["transports"]:
        return "not checked (no NCCL channel was set up)"
    environ = os.environ if environ is None else environ
    said = []
    for fallback in fallbacks(found, hosts):
        set_here = [f"{v}={environ[v]}" for v in CAUSES[fallback] if v in environ]
        said.append(f"{fallback} (usual causes: {', '.join(CAUSES[fallback])}"
                    + (f"; set here: {', '.join(set_here)}" if set_here else "") + ")")
    return f"fallback: {'; '.join(said)}" if said else "ok"
