"""raybench command line: a thin layer over raybench.api.

Exit codes: 0 success (every trial ok), 1 the sweep ran but some trials did not end ok, 2 bad input
(nothing was launched or written).
"""

from __future__ import annotations

import argparse
import json
import sys

from raybench.config import ConfigError, load_sweep

EXIT_OK, EXIT_TRIALS_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors are bad input too
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _validate(args) -> int:
    spec = load_sweep(args.sweep)
    from raybench.plan import plan

    trials = plan(spec, keep_invalid=args.keep_invalid, source=args.sweep)
    print(f"{args.sweep}: ok ({len(trials)} trials)")
    return EXIT_OK


def _plan(args) -> int:
    from raybench.plan import plan
    from raybench.report import plan_table

    spec = load_sweep(args.sweep)
    trials = plan(spec, keep_invalid=args.keep_invalid, source=args.sweep)
    if args.json:
        for t in trials:
            print(json.dumps({**t.as_payload(), "status": t.status, "reasons": list(t.reasons)}, sort_keys=True))
    else:
        print(plan_table(trials))
        print(f"\n{len(trials)} trials, sweep '{spec.name}', executor {spec.executor}")
    return EXIT_OK


def _run(args) -> int:
    from raybench.api import read_results, run_sweep
    from raybench.report import results_table

    spec = load_sweep(args.sweep)
    store_path = args.store or spec.store
    progress = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    trials = run_sweep(spec, address=args.address, store_path=store_path, keep_invalid=args.keep_invalid,
                       rerun=args.rerun, progress=progress, verbose=args.verbose, source=args.sweep)
    rows = read_results(store_path, spec.name)
    print(results_table(rows))
    ran = rows[rows.trial_id.isin({t.trial_id for t in trials})]
    failed = int((ran.status != "ok").sum())
    print(f"\n{len(ran)} trial(s) run, {failed} not ok; results in {store_path}")
    return EXIT_TRIALS_FAILED if failed else EXIT_OK


def _trial(args) -> int:
    from raybench import executors
    from raybench.api import read_results
    from raybench.plan import plan
    from raybench.report import results_table
    from raybench.trial import run_trial

    spec = load_sweep(args.sweep)
    trials = plan(spec, source=args.sweep)
    chosen = [t for t in trials if args.id in (t.trial_id, t.config_id, str(t.index))]
    if not chosen:
        print(f"{args.sweep}: no trial with id or index {args.id!r}; see `raybench plan {args.sweep}`",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    store_path = args.store or spec.store
    row = run_trial(chosen[0].as_payload(), spec.name, store_path, "torchrun", executors.get("torchrun"))
    rows = read_results(store_path, spec.name)
    print(results_table(rows[rows.trial_id == row["trial_id"]]))
    return EXIT_OK if row["status"] == "ok" else EXIT_TRIALS_FAILED


def _report(args) -> int:
    from raybench.api import read_results
    from raybench.report import results_table

    print(results_table(read_results(args.store, args.sweep, latest=not args.all_attempts)))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raybench", description="Benchmark LLM fine-tuning configurations as Ray sweeps.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("validate", help="check a sweep file; report every problem at once")
    p.add_argument("sweep")
    p.add_argument("--keep-invalid", action="store_true", help="accept impossible grid points (as invalid rows)")
    p.set_defaults(func=_validate)

    p = sub.add_parser("plan", help="print the expanded trial table (starts nothing)")
    p.add_argument("sweep")
    p.add_argument("--keep-invalid", action="store_true", help="list impossible grid points as invalid")
    p.add_argument("--json", action="store_true", help="one JSON object per trial instead of a table")
    p.set_defaults(func=_plan)

    p = sub.add_parser("run", help="run a sweep on an embedded local Ray, or on --address")
    p.add_argument("sweep")
    p.add_argument("--address", help="existing Ray cluster (ray://… or host:port); default: private local Ray")
    p.add_argument("--store", help="result store directory (overrides the sweep's store)")
    p.add_argument("--keep-invalid", action="store_true", help="record impossible grid points as invalid rows")
    p.add_argument("--rerun", action="store_true", help="run trials again even if stored as ok")
    p.add_argument("--quiet", action="store_true", help="no per-trial progress lines")
    p.add_argument("--verbose", action="store_true", help="show Ray and worker logs")
    p.set_defaults(func=_run)

    p = sub.add_parser("trial", help="run one planned trial under plain torchrun (no Ray)")
    p.add_argument("sweep")
    p.add_argument("id", help="trial id, config id, or plan index")
    p.add_argument("--store", help="result store directory (overrides the sweep's store)")
    p.set_defaults(func=_trial)

    p = sub.add_parser("report", help="print stored results as a table")
    p.add_argument("store", nargs="?", default="./raybench-results")
    p.add_argument("--sweep", help="only this sweep")
    p.add_argument("--all-attempts", action="store_true", help="every attempt, not only the latest per trial")
    p.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(err.report(), file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
