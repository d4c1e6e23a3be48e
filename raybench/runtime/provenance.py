"""Where and with what a trial ran: every rank's hostname, the all-reduce probe, and the row's hardware, software
and environment columns; the same for raybench's own loop and for a user's stack."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from raybench.runtime import allreduce, fingerprint, nccl_log
from raybench.runtime.strategies import RankContext
from raybench.spec import hardware as hardware_table
from raybench.spec.payload import TrialPayload
from raybench.spec.sweep_spec import TrialConfig


def hostnames_and_busbw(payload: TrialPayload, ctx: RankContext) -> tuple[list[str], dict]:
    """Every rank's hostname, and the all-reduce bus bandwidth between them (cached per cluster).

    Measured before the model and the warm-up, so its buffers neither compete for memory nor count in the
    peaks, and are long released when the baseline is read (gloo frees a collective's scratch buffers when its
    work object goes, which can be after the call returned). Only trials run for a store (which holds the
    per-cluster cache) probe; bare worker runs skip it."""
    hostnames = [None] * ctx.world_size
    dist.all_gather_object(hostnames, fingerprint.hardware(ctx.device)["hostname"])
    busbw = {}
    if ctx.world_size > 1 and payload.cache_dir:
        busbw = allreduce.cached_measure(ctx.device, ctx.rank, ctx.world_size, hostnames, payload.cache_dir)
    return hostnames, busbw


def transport_check(ctx: RankContext, hostnames: list[str]) -> dict:
    """NCCL's transports over every rank's communicators and whether one is a fallback (nccl_log), for the row;
    every rank calls it, after the trial's first collectives (its channels are set up lazily)."""
    if ctx.device.type != "cuda":
        return {"nccl_transports_json": None, "nccl_transport_check": "not checked (gloo)"}
    log = nccl_log.logged()
    mine = None if log is None else nccl_log.transports(log)
    found = [None] * ctx.world_size
    dist.all_gather_object(found, mine)
    merged = None if None in found else nccl_log.merged(found)
    return {"nccl_transports_json": json.dumps(merged) if merged else None,
            "nccl_transport_check": nccl_log.check_text(merged, len(set(hostnames)))}


NOT_CHECKED_STACK = {"nccl_transports_json": None, "nccl_transport_check": "not checked (the user's command)"}


def columns(config: TrialConfig, ctx: RankContext, hostnames: list[str], busbw: dict, hardware: dict, nccl: dict,
            software: dict | None = None) -> dict:
    """Where and with what the trial ran: the row's hardware and software columns (software: the versions of
    the environment the trial ran in; None: this process's). The environment variables and the system label are
    fields of their own (`rank_metrics.rank_result`)."""
    return {
        "world_size": ctx.world_size,
        "hostnames": sorted(set(hostnames)),
        "allreduce_busbw_gbps": max(busbw.values()) if busbw else None,
        "allreduce_busbw_json": json.dumps(busbw) if busbw else None,
        **nccl,
        "data_fs_type": fingerprint.filesystem_of(config.data.path or config.model.path or os.getcwd()),
        **hardware,
        **(fingerprint.software() if software is None else software),
    }


def nominal_link_gbps(gpu_name: str | None, hostnames: list[str]) -> float | None:
    """The nominal rate, GB/s each way, of the link a trial's ranks span: NVLink when they share one node, one NIC
    across nodes (the hardware table's); None on CPUs or a GPU the table lacks."""
    link = hardware_table.nominal_link(gpu_name) if gpu_name else None
    if link is None:
        return None
    return link.nvlink_gbps if len(set(hostnames)) <= 1 else link.nic_gbps
