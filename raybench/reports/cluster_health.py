"""The cluster-health section of `raybench report`: each cluster's latest pre-flight (`raybench cluster check`,
results/health.py), a line per device, the slow ones with what is slow. docs/slurm.md says how to read it."""

from __future__ import annotations

from raybench.reports.report import cell

CAPTION = "Cluster health (each cluster's latest pre-flight)"
HEADERS = ["cluster", "checked", "node", "device", "matmul TFLOP/s", "memory GB/s", "host→device GB/s",
           "least of fastest", "slow: why"]


def health_rows(checks) -> list[list[str]]:
    """Rows of the section from `health.read_checks`'s table (none when no cluster was checked)."""
    rows = []
    for r in checks.to_pylist():
        fractions = [r[f"{f}_of_fastest"] for f in ("matmul_tflops", "memory_gb_per_s", "host_to_device_gb_per_s")]
        where = r["node"] + (f" gpu{r['device_index']}" if r["device_index"] is not None else "")
        rows.append([r["cluster"] or "-", r["checked_at"], where, r["device"], cell(r["matmul_tflops"], ".3g"),
                     cell(r["memory_gb_per_s"], ".3g"), cell(r["host_to_device_gb_per_s"], ".3g"),
                     f"{min(f for f in fractions if f is not None):.0%}", r["why"] if r["slow"] else "-"])
    return rows
