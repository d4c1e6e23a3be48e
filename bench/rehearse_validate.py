"""Rehearsed vs measured, per row, on committed GPU results, reported apart for the rows that fitted the
rehearsal's constants and the rows held out (bench/validation_split.yaml).

    .venv/bin/python bench/rehearse_validate.py [--heldout-only] [--file PARQUET ...]
    .venv/bin/python bench/rehearse_validate.py [--sweep NAME ...] [--results DIR --gpu NAME]
    .venv/bin/python bench/rehearse_validate.py --profile STORE/calibration/H100.json ...

By default every committed GPU Parquet file (docs/results/gpu-*/*.parquet) is compared, each for the GPU its
rows ran on (the split file's `gpu`; an unlisted file's own gpu_name). --file picks files; --sweep/--results/--gpu
pick <results>/<sweep>.parquet as before (default folder docs/results/gpu-2026-11-22, sweeps gpu-sac-1b and
gpu-seed000-1gpu when --results is given alone). --heldout-only rehearses the held-out rows only. --profile prices
every row with a measured device profile (`raybench calibrate`) instead of the shipped constants.

Each configuration of the file's sweep (bench/sweeps/<sweep>.yaml) is rehearsed for that GPU and joined to its
measured row by trial id (a repeated configuration is rehearsed once and compared with each repeat). Each row is
marked with its set: a row listed in the split file under a constant fitted that constant; every other committed
row is held out. Prints a Markdown table per file, which rows fitted what, then one JSON line per file with the
worst errors, then one JSON line per set (step time median and max |error|, tensor and reserved peak errors), the
held-out set in three parts (new configurations on blind rows, the score; repeats of a fitted configuration on
another day or GPU; rows that shaped a change, `not_blind` in the split file), and last the headline line: its
"value" is the held-out rows' median |step time error|. Nothing is fitted here: the rehearsal's constants
(raybench/rehearse/fitted.py: ROOFLINE_EFFICIENCY, ALLOCATOR_RESERVE, ALLOCATOR_RESERVE_FROZEN_BASE,
COMPILED_BYTE_COST) are
printed with the results, and what each row alone would make them (the implied values). Then, for a gpu-sac-1b
file rehearsed whole, the best ratio per micro-batch x compile as `raybench best --predict` picks it (the
estimate's memory limit and margin for that GPU) against the measured best, and the op-level policy torch's SAC
ILP picks within the same limit (from the ratio-1 rehearsal) against the same measured best.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

from raybench.planning.estimate import estimate
from raybench.planning.plan import config_id, plan
from raybench.rehearse import fitted, rehearsal
from raybench.rehearse.choice import predicted_best
from raybench.results import rehearsals
from raybench.results.store import measured_trial_config
from raybench.spec.load import load_sweep
from raybench.spec.sweep_spec import TrialConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validation_split  # bench/validation_split.py

REPO = Path(__file__).resolve().parent.parent
SWEEPS = ("gpu-sac-1b", "gpu-seed000-1gpu")
# gpu-validate: one row per strategy and technique, 1B at seq 1024; gpu-rehearse-check: what the H100 rows left open;
# gpu-h100-recheck: the one H100 row still outside the bound, and its neighbours, twice.
OTHER_SWEEPS = ("gpu-validate", "gpu-rehearse-check", "gpu-h100-recheck")
RESULTS = REPO / "docs" / "results" / "gpu-2026-11-22"
GPU = "H100 SXM"
COLUMNS = ["set", "fitted", "trial_id", "not_blind", "config", "method", "notes", "rehearsed_gib", "alloc_gib",
           "alloc_err", "reserved_pred_gib", "reserved_gib", "reserved_err", "step_pred_s", "step_s", "step_err",
           "implied_efficiency", "implied_byte_cost", "compiled_traffic", "reserve"]


REDUCER_NOTE = "not compared: the row ran DDP's reducer on one rank, which trials no longer build"


def sweep_for_gpu(name: str, gpu: str):
    """The committed sweep, with estimate.gpu set to the GPU its rows ran on. Its rows ran before train.loss auto,
    so a sweep that leaves the loss at auto is planned chunked, the default of their day: its ids leave the loss out,
    as the rows' do, whatever auto would pick on this GPU."""
    spec = load_sweep(REPO / "bench" / "sweeps" / f"{name}.yaml")
    train = spec.train.model_copy(update={"loss": "chunked"}) if spec.train.loss == "auto" else spec.train
    return spec.model_copy(update={"estimate": spec.estimate.model_copy(update={"gpu": gpu}), "train": train})


def measured_rows(parquet: Path) -> pd.DataFrame:
    """The sweep's ok rows by trial id. The warm pool of that day kept a failed trial's GPU memory in the
    peaks of the trials after it (fixed since, docs/results/gpu-2026-11-22.md): rows that ended after a failed
    trial of their sweep are left out (gpu-validate's after its first ZeRO-3 attempt). An interrupted trial is not
    such a failure: its sweep was stopped, and the rows after it ran on a new pool."""
    measured = pd.read_parquet(parquet)
    first_failure = measured.loc[~measured.status.isin(["ok", "interrupted"]), "ended_at"].min()
    return measured[(measured.status == "ok") & ~(measured.ended_at > first_failure)].set_index("trial_id")


def stored_ids_by_planned_id(measured: pd.DataFrame) -> dict[str, str]:
    """{the trial id today's plan gives a row's configuration: the row's own trial id}. They differ for LoRA rows
    from before train.lora.base_dtype: their config_json lacks it, and a plan of the same sweep resolves it
    (auto) into a new id; the row itself measured the config `store.measured_trial_config` reads."""
    return {f"{config_id(TrialConfig.model_validate(json.loads(row.config_json)))}-r{row['repeat']}": stored
            for stored, row in measured.iterrows()}


def validate(entry: validation_split.FileEntry, gpu: str, store: Path, traces: dict,
             heldout_only: bool = False, priced: fitted.Calibration = fitted.SHIPPED_CALIBRATION,
             ) -> tuple[pd.DataFrame, dict]:
    """The file's rows rehearsed for `gpu`, each marked with its set; `traces` is kept per GPU by the caller.
    Each row is rehearsed as it was measured (store.measured_trial_config), joined to its planned trial for
    the trial's shape and checkpointed blocks, and priced by `priced` (the shipped constants, or a profile)."""
    name = entry.sweep
    measured = measured_rows(REPO / entry.path)
    stored_ids = stored_ids_by_planned_id(measured)
    lines = []
    for trial in plan(sweep_for_gpu(name, gpu)):
        stored_id = stored_ids.get(trial.trial_id)
        if stored_id is None:
            continue
        fitted_on = entry.constants_fitted_on(stored_id)
        if heldout_only and fitted_on:
            continue
        row = measured.loc[stored_id]
        config = measured_trial_config(row.config_json)
        analytic = estimate(config, trial.shape, list(trial.ac_blocks), gpu)
        r = rehearsal.rehearse(config, trial.shape, gpu, analytic=analytic, traces=traces, calibration=priced)
        rehearsals.save_rehearsal(store, trial.config_id, r.as_dict())
        reserved = None if r.peak_gib is None else r.peak_gib * priced.for_finetune(config.train.tuning).reserve
        # One-rank DDP rows ran DDP's reducer, which holds a bucket copy of every gradient and copies each gradient
        # into it; today's one-rank trial runs without DDP (2026-12-07), so neither its memory nor its step is the
        # row's: those rows are not compared.
        kept_reducer = config.train.parallelism.reducer and config.resources.workers == 1
        rehearsed_gib = None if kept_reducer else r.peak_gib
        reserved = None if kept_reducer else reserved
        step_s = None if kept_reducer else r.step_time_s
        lines.append({
            "set": validation_split.FITTING if fitted_on else validation_split.HELDOUT,
            "fitted": ", ".join(fitted_on) or "-", "trial_id": stored_id,
            "not_blind": entry.not_blind.get(stored_id),
            "config": ", ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in trial.axis_values.items()
                                if k != "train.ac_mode") + (f", r{trial.repeat}" if trial.repeat else ""),
            "method": r.method, "notes": "; ".join(r.notes + [REDUCER_NOTE] * kept_reducer) or "-",
            "rehearsed_gib": rehearsed_gib, "alloc_gib": row.peak_alloc_gib,
            "alloc_err": _err(rehearsed_gib, row.peak_alloc_gib),
            "reserved_pred_gib": reserved, "reserved_gib": row.peak_reserved_gib,
            "reserved_err": _err(reserved, row.peak_reserved_gib),
            "step_pred_s": step_s, "step_s": row.step_time_p50_s, "step_err": _err(step_s, row.step_time_p50_s),
            # What each row alone would make the fitted constants (single-rank rows: no communication).
            "implied_efficiency": None if r.roofline_s is None or step_s is None else (
                r.roofline_s / row.step_time_p50_s),
            "implied_byte_cost": None if not (r.block_memory_bound_s and r.compiled_traffic) else (
                1 - (r.roofline_s - priced.efficiency * row.step_time_p50_s) / r.block_memory_bound_s
            ) / r.compiled_traffic,
            "compiled_traffic": r.compiled_traffic,
            "reserve": row.peak_reserved_gib / row.peak_alloc_gib,
        })
    table = pd.DataFrame(lines, columns=COLUMNS)
    eager = table[(table.method == "traced") & ~table.notes.str.contains("compile")]
    compiled = table[(table.method == "traced") & table.notes.str.contains("compile")]
    summary = {"file": entry.path, "sweep": name, "gpu": gpu, "rows": len(table),
               "fitting_rows": int((table.set == validation_split.FITTING).sum()),
               "heldout_rows": int((table.set == validation_split.HELDOUT).sum()), "eager_rows": len(eager),
               "max_abs_alloc_err_eager": _max_abs(eager.alloc_err),
               "max_abs_reserved_err_eager": _max_abs(eager.reserved_err),
               "max_abs_step_err_eager": _max_abs(eager.step_err), "max_abs_alloc_err_all": _max_abs(table.alloc_err),
               "max_abs_step_err_all": _max_abs(table.step_err),
               "max_abs_step_err_compiled": _max_abs(compiled.step_err),
               "roofline_efficiency": priced.efficiency, "allocator_reserve": priced.reserve,
               "compiled_byte_cost": fitted.COMPILED_BYTE_COST,
               "median_implied_efficiency_eager": _median(eager.implied_efficiency),
               "median_reserve_eager": _median(eager.reserve),
               "median_implied_byte_cost_compiled": _median(compiled.implied_byte_cost),
               "compiled_traffic": _median(compiled.compiled_traffic)}
    return table, summary


def best_ratios(name: str, store: Path, parquet: Path, gpu: str) -> list[dict]:
    """Per group (micro-batch x compile): the sAC ratio the rehearsals predict best within the GPU's memory
    (estimate margin included), and the measured best among the ok rows."""
    measured = measured_rows(parquet)
    trials = plan(sweep_for_gpu(name, gpu), store_path=store)
    by_id = {t.trial_id: t for t in trials}
    out = []
    for result in predicted_best(trials, rehearsals=rehearsals.rehearsals(store)):
        ids = [t.trial_id for t in trials if all(str(t.axis_values.get(k)) == v for k, v in result["group"].items())]
        rows = measured.loc[[i for i in ids if i in measured.index]]
        best_row = rows.loc[rows.tok_per_s_per_device.idxmax()] if len(rows) else None
        out.append({"group": result["group"], "predicted": result["best"] and result["best"]["value"],
                    "predicted_tok_s": result["best"] and result["best"]["tok_per_s_per_device"],
                    "measured": None if best_row is None else by_id[best_row.name].axis_values["train.ac_ratio"],
                    "measured_tok_s": None if best_row is None else best_row.tok_per_s_per_device,
                    "values": result["values"], "limit_gib": result["memory_gib"] - result["margin_gib"],
                    "op_policy": result["op_policy"]})
    return out


def _group(b: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in b["group"].items())


def _op_policy_markdown(best: list[dict]) -> str:
    """The op-level policy's predictions per group next to the predicted best ratio and the measured best."""
    headers = ["group", "op-level tok/s/GPU (pred)", "vs predicted best ratio", "vs measured best",
               "reserved + context GiB (pred)", "kept", "saved per block", "recomputed per block"]
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for b in best:
        found = b["op_policy"]
        policy = found.get("policy")
        if policy is None:
            out.append(f"| {_group(b)} | {found.get('why', 'none fits')} |" + " - |" * (len(headers) - 2))
            continue
        tok_s = found["tok_per_s_per_device"]
        out.append(f"| {_group(b)} | {tok_s:.0f} | {_pct(_err(tok_s, b['predicted_tok_s']))} | "
                   f"{_pct(_err(tok_s, b['measured_tok_s']))} | {found['peak_gib']:.1f} | "
                   f"{policy['kept_fraction']:.2f} | {_ops(policy['saved'])} | {_ops(policy['recomputed'])} |")
    return "\n".join(out)


def _ops(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(counts.items())) or "-"


def _err(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or measured is None else predicted / measured - 1


def _median(values: pd.Series) -> list[float] | None:
    """[median, min, max]."""
    values = values.dropna()
    return None if values.empty else [round(float(f(values)), 4) for f in (pd.Series.median, pd.Series.min,
                                                                              pd.Series.max)]


def _max_abs(values: pd.Series) -> float | None:
    values = values.dropna()
    return None if values.empty else round(float(values.abs().max()), 3)


def _markdown(table: pd.DataFrame) -> str:
    headers = ["set", "config", "method", "rehearsed GiB", "alloc GiB", "err", "reserved (pred) GiB", "reserved GiB",
               "err", "step (pred) s", "step s", "err", "notes"]
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in table.itertuples():
        row_set = r.set if r.fitted == "-" else f"{r.set}: {r.fitted}"
        label = row_set + (" (not blind)" if isinstance(r.not_blind, str) else "")
        cells = [label, r.config, r.method, _f(r.rehearsed_gib), _f(r.alloc_gib), _pct(r.alloc_err),
                 _f(r.reserved_pred_gib), _f(r.reserved_gib), _pct(r.reserved_err), _f(r.step_pred_s, 3),
                 _f(r.step_s, 3), _pct(r.step_err), r.notes]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _short(value) -> str:
    """An axis value for a table cell: an op list is summarised by its length."""
    return f"[{len(value)} ops]" if isinstance(value, list) else str(value)


def _f(value, digits: int = 2) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:+.1%}"


def print_best_ratios(store: Path, parquet: Path, gpu: str) -> None:
    print(f"\n### Best sAC ratio per group on an {gpu} (predicted before running vs measured)\n")
    print("| group | predicted best | predicted tok/s/GPU | measured best | measured tok/s/GPU | every ratio: "
          "reserved GiB (pred) / fits |\n|---|---|---|---|---|---|")
    best = best_ratios("gpu-sac-1b", store, parquet, gpu)
    for b in best:
        every = "; ".join(f"{v['value']}: {v['peak_gib']:.1f}/{'yes' if v['fits'] else 'no'}" for v in b["values"])
        print(f"| {_group(b)} | {b['predicted']} | "
              f"{_f(b['predicted_tok_s'], 0)} | {b['measured']} | {_f(b['measured_tok_s'], 0)} | {every} |")
    print(f"\n### Op-level policy per group on an {gpu} (torch's SAC ILP within the same limit) vs measured best\n")
    print(_op_policy_markdown(best))


def set_summary(table: pd.DataFrame) -> dict:
    """Errors over one set's rows (every compared row; `traced`: the rows the trace priced, analytic fallbacks
    left out): step time median and max |error|, tensor peak and reserved peak median and max |error|."""
    def errors(rows: pd.DataFrame) -> dict:
        out = {"rows": len(rows)}
        for column, label in (("step_err", "step"), ("alloc_err", "alloc"), ("reserved_err", "reserved")):
            values = rows[column].dropna().abs()
            out[f"median_abs_{label}_err"] = None if values.empty else round(float(values.median()), 4)
            out[f"max_abs_{label}_err"] = None if values.empty else round(float(values.max()), 4)
        return out

    return {**errors(table), "traced": errors(table[table.method == "traced"]),
            "files": sorted(set(table.file)) if len(table) else []}


def heldout_parts(rows: pd.DataFrame, split: validation_split.Split) -> dict[str, dict]:
    """The held-out rows in three parts: configurations no constant was fitted on, on rows that shaped no change
    (the score); repeats of a fitted configuration (another day or GPU); rows that shaped a change (not blind)."""
    heldout = rows[rows.set == validation_split.HELDOUT]
    repeat = heldout.trial_id.map(validation_split.config_of).isin(split.fitted_configs())
    seen = heldout.not_blind.map(lambda why: isinstance(why, str))
    return {"new configurations, blind": set_summary(heldout[~repeat & ~seen]),
            "repeats of fitted configurations": set_summary(heldout[repeat & ~seen]),
            "not blind": set_summary(heldout[seen])}


def fitted_rows_markdown(split: validation_split.Split, files: list[str]) -> str:
    """Which rows fitted which constant (from the split file), with each row's axis values."""
    out = ["| constant | value | file | rows | configurations | where |", "|---|---|---|---|---|---|"]
    for name, spec in split.constants.items():
        for rel, entry in split.files.items():
            ids = entry.fitting.get(name)
            if not ids:
                continue
            rows = pd.read_parquet(REPO / rel, columns=["trial_id", "axis_values_json"])
            rows = rows.drop_duplicates("trial_id", keep="last").set_index("trial_id")  # a stopped trial's attempts
            configs = sorted({", ".join(f"{k.split('.')[-1]}={v}" for k, v in json.loads(
                rows.loc[i, "axis_values_json"]).items()) for i in ids})
            out.append(f"| {name} | {spec['value']} | {rel}{'' if rel in files else ' (not run)'} | {len(ids)} | "
                       f"{'; '.join(configs)} | {spec['where']} |")
    out.append("\nEvery other committed row is held out: " + ", ".join(
        f"{rel} ({'all' if not split.entry(rel).fitting else 'the rest'})" for rel in
        validation_split.committed_parquets() if not split.entry(rel).fitting or
        split.entry(rel).fitting_ids() != set(pd.read_parquet(REPO / rel, columns=["trial_id"]).trial_id)) + ".")
    not_blind = [f"{rel} {i}: {why}" for rel, entry in split.files.items() for i, why in entry.not_blind.items()]
    if not_blind:
        out.append("Held out but not blind: " + "; ".join(not_blind) + ".")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Rehearsed vs measured on committed GPU rows, fitting and held-out "
                                                 "rows apart.")
    parser.add_argument("--file", action="append", type=Path,
                        help="a Parquet file of GPU rows (repeatable; default: every committed "
                             f"{validation_split.GPU_PARQUETS})")
    parser.add_argument("--sweep", action="append", choices=[*SWEEPS, *OTHER_SWEEPS],
                        help="a sweep to validate from --results (repeatable; with --results alone: "
                             f"{', '.join(SWEEPS)})")
    parser.add_argument("--results", type=Path, help="folder of <sweep>.parquet files (bench/gpu_truth.sh writes "
                                                      f"them; with --sweep alone: {RESULTS.relative_to(REPO)})")
    parser.add_argument("--gpu", help="the GPU those rows ran on, as the hardware table names it (default: the "
                                      "split file's, or the rows' own gpu_name)")
    parser.add_argument("--split", type=Path, default=validation_split.SPLIT,
                        help="the fitting / held-out split (default: bench/validation_split.yaml)")
    parser.add_argument("--heldout-only", action="store_true", help="rehearse the held-out rows only")
    parser.add_argument("--profile", type=Path, help="a `raybench calibrate` profile (STORE/calibration/KEY.json) to "
                        "price every row with, instead of the shipped constants; the rows of other GPUs too")
    args = parser.parse_args()
    priced = fitted.Calibration.from_profile(json.loads(args.profile.read_text())) if args.profile else \
        fitted.SHIPPED_CALIBRATION
    print(f"Priced by: {priced.source} (efficiency {priced.efficiency:.3f}, bandwidth fraction "
          f"{priced.bandwidth_fraction:.3f}, reserve {priced.reserve:.3f}).\n")
    split = validation_split.load(args.split)
    if args.sweep or args.results:
        results = args.results or RESULTS
        files = [validation_split.relative(results.resolve() / f"{name}.parquet") for name in args.sweep or SWEEPS]
    elif args.file:
        files = [validation_split.relative(f.resolve()) for f in args.file]
    else:
        files = validation_split.committed_parquets()
    print(f"Split: {validation_split.relative(args.split.resolve())}. Rows that fitted a constant:\n")
    print(fitted_rows_markdown(split, files))
    summaries, tables, traces_by_gpu = [], [], {}
    for rel in files:
        entry = split.entry(rel)
        gpu = args.gpu or entry.gpu
        if args.heldout_only and entry.fitting_ids() >= set(measured_rows(REPO / rel).index):
            print(f"\n### {rel}\n\nevery compared row fitted a constant: skipped (--heldout-only)")
            continue
        with tempfile.TemporaryDirectory() as store:
            table, summary = validate(entry, gpu, Path(store), traces_by_gpu.setdefault(gpu, {}), args.heldout_only,
                                      priced)
            print(f"\n### {rel} ({entry.sweep}, {gpu})\n\n{_markdown(table)}\n")
            summaries.append(summary)
            tables.append(table.assign(file=rel))
            if entry.sweep == "gpu-sac-1b" and not (args.heldout_only and entry.fitting_ids()):
                print_best_ratios(Path(store), REPO / rel, gpu)
    for summary in summaries:
        print(json.dumps({"bench": "rehearse_validate", **summary}))
    rows = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=[*COLUMNS, "file"])
    by_set = {s: set_summary(rows[rows.set == s]) for s in (validation_split.FITTING, validation_split.HELDOUT)}
    for name, summary in by_set.items():
        print(json.dumps({"bench": "rehearse_validate", "set": name, **summary}))
    heldout = by_set[validation_split.HELDOUT]
    parts = heldout_parts(rows, split)
    for name, summary in parts.items():
        print(json.dumps({"bench": "rehearse_validate", "set": f"held-out: {name}", **summary}))
    print(json.dumps({"bench": "rehearse_validate", "metric": "held-out rows: median |step time error|",
                      "value": heldout["median_abs_step_err"], "heldout": heldout,
                      "heldout_new_blind": parts["new configurations, blind"],
                      "fitting": by_set[validation_split.FITTING],
                      "split": validation_split.relative(args.split.resolve()),
                      "heldout_only": args.heldout_only}))


if __name__ == "__main__":
    main()
