"""The memory estimate and step-time guess of this raybench against measured GPU rows committed in docs/results/.

    .venv/bin/python bench/gpu_estimate_check.py [docs/results/gpu-2026-11-22]

For each `<sweep>.parquet` there whose sweep file `bench/sweeps/<sweep>.yaml` exists: plan that sweep with
`estimate.gpu` set to the rows' GPU (no calibration), then per ok row (latest attempt per trial) print the
memory error (peak_reserved_gib / the estimate's measured part - 1, as `est_peak_error`) and measured step
time / guessed step time. Runs on CPU: nothing is trained.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

REPO = Path(__file__).resolve().parent.parent
GPU_OF_NAME = {"NVIDIA H100 80GB HBM3": "H100 SXM"}  # nvidia-smi name -> the estimate's GPU table key


def check(rows_file: Path) -> None:
    sweep_file = REPO / "bench" / "sweeps" / f"{rows_file.stem}.yaml"
    rows = store.latest_per_trial(pq.read_table(rows_file)).to_pylist()
    ok = [r for r in rows if r["status"] == "ok"]
    if not sweep_file.exists() or not ok:
        return
    raw = yaml.safe_load(sweep_file.read_text())
    raw["estimate"] = {"gpu": GPU_OF_NAME[ok[0]["gpu_name"]]}
    estimates = {t.trial_id: t.assessment.analytic for t in plan(parse_sweep(raw, str(sweep_file)))}
    print(f"{rows_file.stem}: {len(ok)} ok rows")
    print(f"  {'axis values':<90}{'reserved GiB':>13}{'estimate GiB':>13}{'mem error':>10}{'step/guess':>11}")
    errors, ratios = [], []
    for r in ok:
        est = estimates[r["trial_id"]]
        error = r["peak_reserved_gib"] / est.measured_part_gib - 1
        errors.append(error)
        guess = est.step_time_s  # None where the GPU table has no peak for the precision (fp16)
        if guess:
            ratios.append(r["step_time_p50_s"] / guess)
        print(f"  {r['axis_values_json']:<90}{r['peak_reserved_gib']:>13.2f}{est.peak_gib:>13.2f}"
              f"{error:>+10.1%}{r['step_time_p50_s'] / guess if guess else float('nan'):>11.2f}")
    print(f"  memory error {min(errors):+.1%} .. {max(errors):+.1%}; measured / guessed step time: median "
          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})\n")


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "results" / "gpu-2026-11-22"
    for rows_file in sorted(results.glob("*.parquet")):
        check(rows_file)


if __name__ == "__main__":
    main()
