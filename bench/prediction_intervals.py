"""The relative error bands of raybench/planning/uncertainty.py: derived on one set of measurements, their coverage
reported on others.

    .venv/bin/python bench/rehearse_validate.py > validate.out
    .venv/bin/python bench/rehearse_public.py > public.out   # or docs/results/public-corpus-2026-11-28.md
    .venv/bin/python bench/prediction_intervals.py validate.out public.out

The sets, fixed by rules that read no error:
- Rows band: derived on the held-out GPU rows (bench/validation_split.yaml) of DERIVATION_GPU, the GPU the
  rehearsal's constants were fitted on; checked on the held-out rows of every other GPU. Rows that fitted a
  constant are in neither (their errors are the fit's, not a prediction's).
- At-scale term: the public corpus (bench/public_results.yaml), every expressible entry with a predicted figure;
  derived on all of it for the shipped band, checked source by source (repository and path): each source's
  entries against the term derived on the other sources' entries. Memory: the entries whose published memory is
  the peak reserved (the entry's `memory.measures`, read from its source's code); no entry publishes a tensor peak.

Traced errors are read from the two outputs (rehearse_validate.py's per-row tables; rehearse_public.py's table, the
same lines as its docs/results record). Analytic errors (the estimate, what an untraced trial is predicted by) are
computed here for the same rows and entries: nothing is traced, seconds. Prints the derivation and check sets,
the bands and their coverage per set, the corpus per entry, then one JSON line (the figures of `BANDS`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from raybench.planning import uncertainty
from raybench.planning.estimate import estimate
from raybench.planning.plan import plan
from raybench.results.store import measured_trial_config
from raybench.spec.load import parse_sweep

sys.path.insert(0, str(Path(__file__).resolve().parent))
import public_results  # bench/public_results.py
import rehearse_public  # bench/rehearse_public.py
import rehearse_validate  # bench/rehearse_validate.py
import validation_split  # bench/validation_split.py

DERIVATION_GPU = "H100 SXM"
QUANTITIES = ("step_time", "tensor_peak", "reserved_peak")
# Columns of a per-row table of rehearse_validate.py (its `_markdown`): set, config, method, ..., error columns.
ERROR_COLUMNS = {"step_time": 11, "tensor_peak": 5, "reserved_peak": 8}
# Columns of rehearse_public.py's table: set, entry, GPUs, published, predicted, step err, memory measured as,
# published GiB, predicted GiB, mem err (its records before 2026-12-07 had mem err at 8: rerun them).
PUBLIC_STEP, PUBLIC_MEMORY = 5, 9
PERCENT = re.compile(r"[+-]\d+\.\d%")


def _percent(cell: str) -> float | None:
    return abs(float(cell.rstrip("%")) / 100) if PERCENT.fullmatch(cell) else None


def traced_rows(validate_output: Path) -> list[dict]:
    """The held-out traced rows of rehearse_validate.py's printed tables: GPU, file and |error| per quantity."""
    rows, gpu, rel = [], None, None
    for line in validate_output.read_text().splitlines():
        header = re.match(r"### (\S+\.parquet) \((\S+), (.+)\)$", line)
        if header:
            rel, gpu = header.group(1), header.group(3)
        if not line.startswith(f"| {validation_split.HELDOUT}"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[2] == "traced":
            rows.append({"file": rel, "gpu": gpu, **{q: _percent(cells[c]) for q, c in ERROR_COLUMNS.items()}})
    return rows


def analytic_rows() -> list[dict]:
    """The analytic estimate on every held-out row (nothing traced): GPU, file and |error| per quantity."""
    split = validation_split.load()
    rows = []
    for rel in validation_split.committed_parquets():
        entry = split.entry(rel)
        measured = rehearse_validate.measured_rows(rehearse_validate.REPO / rel)
        stored_ids = rehearse_validate.stored_ids_by_planned_id(measured)
        for trial in plan(rehearse_validate.sweep_for_gpu(entry.sweep, entry.gpu)):
            stored_id = stored_ids.get(trial.trial_id)
            if stored_id is None or entry.constants_fitted_on(stored_id):
                continue
            row = measured.loc[stored_id]
            est = estimate(measured_trial_config(row.config_json), trial.shape, list(trial.ac_blocks), entry.gpu)
            rows.append({"file": rel, "gpu": entry.gpu,
                         "step_time": float(abs(est.step_time_s / row.step_time_p50_s - 1)),
                         "tensor_peak": float(abs(est.measured_part_gib / row.peak_alloc_gib - 1)),
                         "reserved_peak": float(abs(est.measured_part_gib / row.peak_reserved_gib - 1))})
    return rows


def published_table(public_output: Path) -> dict[str, dict]:
    """{entry id: |step err|, |mem err|} from rehearse_public.py's table (its output, or its docs/results record)."""
    out = {}
    for line in public_output.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in ("seen", "unseen") and len(cells) > PUBLIC_MEMORY:
            out[cells[1]] = {"set": cells[0], "step_time": _percent(cells[PUBLIC_STEP]),
                             "reserved_peak": _percent(cells[PUBLIC_MEMORY])}
    return out


def reserved_is_published(entry: public_results.PublicEntry) -> bool:
    """The entry publishes the peak reserved memory (its source's code says so), what the rehearsal's reserved peak
    predicts."""
    return bool(entry.memory) and entry.memory["measures"] == "max_reserved"


def corpus_points(public_output: Path) -> list[dict]:
    """Per expressible corpus entry with a traced figure: its source, parameters, world size and reach, and |error|
    per basis and quantity (None where nothing is published). The analytic estimate is planned here."""
    traced = published_table(public_output)
    points = []
    with tempfile.TemporaryDirectory() as store:
        for entry in public_results.load():
            if entry.not_expressible or entry.id not in traced:
                continue
            (trial,) = plan(parse_sweep(rehearse_public.sweep_for(entry), source=entry.id), store_path=store)
            est = trial.assessment.analytic
            memory = entry.published_memory_gib if reserved_is_published(entry) else None
            points.append({
                "id": entry.id, "set": traced[entry.id]["set"],
                "source": f"{entry.source.get('repo') or entry.source.get('url') or entry.source.get('paper')}"
                          f"/{entry.source.get('path', '')}".rstrip("/"),
                "params": est.params_total, "world": trial.world_size, "nodes": entry.nodes,
                "reach": uncertainty.reach(est.params_total, trial.world_size),
                "traced": {"step_time": traced[entry.id]["step_time"],
                           "reserved_peak": traced[entry.id]["reserved_peak"] if memory else None},
                "analytic": {"step_time": abs(est.step_time_s / entry.published_step_s - 1),
                             "reserved_peak": abs(est.measured_part_gib / memory - 1) if memory else None}})
    return points


def _errors(rows: list[dict], quantity: str) -> list[float]:
    return [float(r[quantity]) for r in rows if r[quantity] is not None]


def rows_bands(derivation: list[dict]) -> dict[str, float]:
    return {q: round(uncertainty.quantile(_errors(derivation, q)), 3) for q in QUANTITIES}


def _with(points: list[dict], basis: str, quantity: str) -> list[dict]:
    return [p for p in points if p[basis][quantity] is not None]


def at_scale_extra(points: list[dict], basis: str, quantity: str, rows_band: float) -> float:
    chosen = _with(points, basis, quantity)
    return uncertainty.at_scale_extra([p[basis][quantity] for p in chosen], [p["reach"] for p in chosen], rows_band)


def corpus_coverage(points: list[dict], basis: str, quantity: str, rows_band: float) -> dict:
    """Coverage on the corpus: the rows band alone; the shipped band (term derived on every entry: in-sample);
    and each source against the term derived without it (the check)."""
    chosen = _with(points, basis, quantity)
    if not chosen:
        return {"entries": 0}
    errors = [p[basis][quantity] for p in chosen]
    shipped = at_scale_extra(points, basis, quantity, rows_band)
    checked, by_source = [], {}
    for source in sorted({p["source"] for p in chosen}):
        others = [p for p in points if p["source"] != source]
        extra = at_scale_extra(others, basis, quantity, rows_band)
        mine = [p for p in chosen if p["source"] == source]
        hits = [bool(p[basis][quantity] <= rows_band + extra * p["reach"]) for p in mine]
        checked += hits
        by_source[source] = {"entries": len(mine), "extra_without_it": round(extra, 3), "covered": sum(hits)}
    return {"entries": len(chosen),
            "rows_band_alone": round(uncertainty.coverage(errors, [rows_band] * len(chosen)), 3),
            "shipped_in_sample": round(uncertainty.coverage(
                errors, [rows_band + shipped * p["reach"] for p in chosen]), 3),
            "leave_one_source_out": round(sum(checked) / len(checked), 3), "by_source": by_source}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _sets(rows: list[dict]) -> str:
    count = defaultdict(int)
    for r in rows:
        count[r["file"]] += 1
    return ", ".join(f"{f} ({n})" for f, n in sorted(count.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validate_output", type=Path, help="the saved output of bench/rehearse_validate.py")
    parser.add_argument("public_output", type=Path, help="the saved output of bench/rehearse_public.py (or its "
                                                         "docs/results record: the same table)")
    args = parser.parse_args()
    rows_by_basis = {"traced": traced_rows(args.validate_output), "analytic": analytic_rows()}
    points = corpus_points(args.public_output)
    bands, checks, sets = {}, {}, []
    print("## Rows band: derived on one GPU's held-out rows, checked on the other GPUs'\n")
    print("| basis | quantity | derivation rows | band: p90 \\|err\\| | check rows | check coverage "
          "| check max \\|err\\| |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for basis, rows in rows_by_basis.items():
        derivation = [r for r in rows if r["gpu"] == DERIVATION_GPU]
        check = [r for r in rows if r["gpu"] != DERIVATION_GPU]
        rows_band = rows_bands(derivation)
        bands[basis] = {"rows": rows_band, "at_scale": {}}
        checks[basis] = {}
        for q in QUANTITIES:
            errors = _errors(check, q)
            covered = uncertainty.coverage(errors, [rows_band[q]] * len(errors))
            checks[basis][q] = {"derivation_rows": len(_errors(derivation, q)), "check_rows": len(errors),
                                "check_coverage": round(covered, 3)}
            print(f"| {basis} | {q} | {len(_errors(derivation, q))} | {_pct(rows_band[q])} | {len(errors)} | "
                  f"{covered:.0%} | {_pct(max(errors))} |")
        sets += [f"- {basis}: derivation set {_sets(derivation)}", f"- {basis}: check set {_sets(check)}"]
    print("\n" + "\n".join(sets) + "\n")
    print("## At-scale term: derived on the public corpus, checked source by source\n")
    print("| basis | quantity | entries | rows band alone: coverage | at-scale term (all entries) | band at reach 1 "
          "| coverage, each source against the term derived without it |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for basis in rows_by_basis:
        for q in ("step_time", "reserved_peak"):
            rows_band = bands[basis]["rows"][q]
            found = corpus_coverage(points, basis, q, rows_band)
            extra = round(at_scale_extra(points, basis, q, rows_band), 3)
            bands[basis]["at_scale"][q] = extra
            checks[basis][f"corpus_{q}"] = found
            if found["entries"]:
                print(f"| {basis} | {q} | {found['entries']} | {found['rows_band_alone']:.0%} | {_pct(extra)} | "
                      f"{_pct(rows_band + extra)} | {found['leave_one_source_out']:.0%} |")
        # No corpus entry publishes a tensor peak: the tensor band widens as the reserved peak's does.
        bands[basis]["at_scale"]["tensor_peak"] = bands[basis]["at_scale"]["reserved_peak"]
    for basis in rows_by_basis:
        for q in ("step_time", "reserved_peak"):
            for source, found in checks[basis][f"corpus_{q}"].get("by_source", {}).items():
                print(f"- {basis} {q}, {source}: {found['covered']} of {found['entries']} covered "
                      f"(term derived without it: {_pct(found['extra_without_it'])})")
    print("\n## Corpus entries (traced |err|; band: rows + term x reach, the shipped term)\n")
    print("| set | entry | params (B) | GPUs | reach | step \\|err\\| | step band | reserved \\|err\\| "
          "| reserved band |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    traced_band = bands["traced"]
    for p in sorted(points, key=lambda p: (p["reach"], p["id"])):
        width = {q: traced_band["rows"][q] + traced_band["at_scale"][q] * p["reach"] for q in QUANTITIES}
        print(f"| {p['set']} | {p['id']} | {p['params'] / 1e9:.1f} | {p['world']} | {p['reach']:.2f} | "
              f"{_pct(p['traced']['step_time'])} | {_pct(width['step_time'])} | "
              f"{_pct(p['traced']['reserved_peak'])} | {_pct(width['reserved_peak'])} |")
    print("\n## Traced step time's band by where the step runs (a check, not part of the derivation)\n")
    print("| entries | n | covered | p90 \\|err\\| | max \\|err\\| | unseen | unseen covered |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, chosen in (("on one node", [p for p in points if p["nodes"] == 1]),
                          ("across nodes", [p for p in points if p["nodes"] > 1])):
        errors = [p["traced"]["step_time"] for p in chosen]
        covered = [p for p in chosen if p["traced"]["step_time"] <= traced_band["rows"]["step_time"]
                   + traced_band["at_scale"]["step_time"] * p["reach"]]
        unseen = [p for p in chosen if p["set"] == "unseen"]
        print(f"| {label} | {len(chosen)} | {len(covered)} | {_pct(uncertainty.quantile(errors))} | "
              f"{_pct(max(errors))} | {len(unseen)} | {sum(p in covered for p in unseen)} |")
    print(json.dumps({"bench": "prediction_intervals", "quantile": uncertainty.QUANTILE,
                      "derivation_gpu": DERIVATION_GPU, "bands": bands, "checks": checks}))


if __name__ == "__main__":
    main()
