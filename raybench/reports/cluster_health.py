"""The cluster-health section of `raybench report`: each cluster's latest pre-flight (`raybench cluster check`,
results/health.py), a line per device, the slow ones with what is slow. docs/slurm.md says how to read it."""

from __future__ import annotations

from raybench.reports.report import cell

CAPTION = "Cluster health (each cluster's latest pre-flight)"
HEADERS = ["cluster", "checked", "node or link", "device", "matmul TFLOP/s", "memory GB/s", "host→device GB/s",
           "all-reduce bus GB/s", "least of fastest", "slow: why"]
DEVICE_FIGURES = ("matmul_tflops", "memory_gb_per_s", "host_to_device_gb_per_s", "busbw_gb_per_s")


def health_rows(checks) -> list[list[str]]:
    """Rows of the section from `health.read_checks`'s table (none when no cluster was checked): a device's, then
    a link's (a node's GPUs among themselves, `node inside`; a node pair, `a<->b`)."""
    rows = []
    for r in checks.to_pylist():
        fractions = [r[f"{f}_of_fastest"] for f in DEVICE_FIGURES if r[f"{f}_of_fastest"] is not None]
        if r["link"]:
            where = f"{r['node']}<->{r['peer_node']}" if r["peer_node"] else f"{r['node']} inside"
            device = f"{r['device']}, {r['link_ranks']} ranks"
        else:
            index = f" gpu{r['device_index']}" if r["device_index"] is not None else ""
            where, device = r["node"] + index, r["device"]
        rows.append([r["cluster"] or "-", r["checked_at"], where, device,
                     *(cell(r[f], ".3g") for f in DEVICE_FIGURES),
                     f"{min(fractions):.0%}" if fractions else "-", r["why"] if r["slow"] else "-"])
    return rows
