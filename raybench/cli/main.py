"""raybench command line: a thin layer over raybench.drivers.api.

Exit codes: 0 success (every trial ok), 1 the sweep ran but some trials did not end ok, or a row could not be
stored (a full disk: the sweep stops, saying which file and how much space is left), 2 bad input (nothing was
launched or written).

Commands that need heavy libraries import them when they run (the API and sweep driver load Optuna and,
when a sweep starts, Ray; `best` and result views load pandas), so `validate`, `plan` and `estimate` stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raybench.cli import cluster as cli_cluster
from raybench.cli import example_data as cli_example_data
from raybench.cli import rehearse as cli_rehearse
from raybench.cli import results as cli_results
from raybench.cli import store as cli_store
from raybench.drivers import requeue, slurm
from raybench.drivers.slurm import SlurmError
from raybench.planning.plan import load_checked, matching, plan
from raybench.reports.report import results_table, terminal_width
from raybench.reports.tables import estimate_summary, estimate_table, plan_table
from raybench.results.store import StoreWriteError
from raybench.runtime import cuda_snapshot
from raybench.spec.errors import ConfigError, Problem

EXIT_OK, EXIT_TRIALS_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # SIGTERM / Ctrl-C: stored rows are kept; the same command resumes the sweep


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors are bad input too
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _validate(args) -> int:
    spec = load_checked(args.sweep)

    trials = plan(spec, keep_invalid=args.keep_invalid, source=args.sweep)
    print(f"{args.sweep}: ok ({len(trials)} trials)")
    return EXIT_OK


def _plan(args) -> int:
    spec = load_checked(args.sweep)
    trials = plan(spec, keep_invalid=args.keep_invalid, source=args.sweep, store_path=args.store or spec.store)
    if args.json:
        for t in trials:
            print(json.dumps({**t.payload.to_dict(), "status": t.status, "reasons": list(t.reasons)}, sort_keys=True))
    else:
        print(plan_table(trials))
        print(f"\n{len(trials)} trials, sweep '{spec.name}', executor {spec.executor_text}")
    return EXIT_OK


def _estimate(args) -> int:
    spec = load_checked(args.sweep)
    store_path = args.store or spec.store
    trials = plan(spec, keep_invalid=args.keep_invalid, source=args.sweep, store_path=store_path)
    if args.json:
        for t in trials:
            print(json.dumps({"index": t.index, "trial_id": t.trial_id, "axis_values": t.axis_values,
                              "status": t.status, "reasons": list(t.reasons),
                              "estimate": t.assessment.as_dict() if t.assessment else {}}, sort_keys=True))
    else:
        print(estimate_table(trials))
        print(f"\n{estimate_summary(trials, store_path)}")
    return EXIT_OK


def _calibrate(args) -> int:
    """Measure the device the rehearsal prices trials on and store its profile (one per device type)."""
    import torch

    from raybench.rehearse.fitted import measure_profile
    from raybench.reports.device_profile import profile_report
    from raybench.results.profiles import save_profile

    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        print("raybench calibrate --device cuda: no CUDA device visible (--device cpu calibrates the CPU)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    command = ("raybench calibrate" + (f" --device {args.device}" if args.device else "")
               + (" --quick" if args.quick else ""))
    profile = measure_profile(kind, args.quick, command, progress=None if args.json else print)
    path = save_profile(args.store, profile)
    print(json.dumps({**profile, "path": str(path)}, sort_keys=True) if args.json else profile_report(profile, path))
    return EXIT_OK


def _run(args) -> int:
    from raybench.drivers import split_run
    from raybench.drivers.api import run_sweep
    from raybench.reports.best import run_report

    spec = load_checked(args.sweep)
    address = args.address
    if args.cluster:  # before anything imports ray: the cluster's token must be in the environment first
        address = slurm.connect(args.cluster)
    store_path = args.store or spec.store
    journal = split_run.child_journal()
    if split_run.splits(args.cluster, args.slurm_job):
        # The driver in a child: Ray may end it without a word as the allocation ends (split_run).
        code, stopped = split_run.run_in_child(args.argv, spec, store_path, args.sweep, cluster=args.cluster)
        if stopped is None:
            return code
        why, tally = stopped
        return _interrupted(why, tally, store_path, args.cluster)
    from raybench.drivers.progress import SweepProgress
    from raybench.drivers.ray_cluster import Terminated, stop_sweep, terminate_on_sigterm

    progress = SweepProgress.for_terminal(args.quiet, args.verbose)
    if journal is not None:
        progress.keep_journal(journal)
    try:
        with terminate_on_sigterm(), progress:
            if args.cluster:  # its allocation may end mid-sweep (time limit, scancel): stop at once, not via Ray
                slurm.watch_allocation(args.cluster, on_end=stop_sweep)
            done = run_sweep(spec, address=address, store_path=store_path, keep_invalid=args.keep_invalid,
                             rerun=args.rerun, progress=progress, verbose=args.verbose, source=args.sweep)
    except (Terminated, KeyboardInterrupt) as why:
        # Every finished trial's row is already stored (each is written atomically when its trial ends).
        return _interrupted(str(why) or "Ctrl-C", progress.tally(), store_path, args.cluster)
    # The sweep's rows, the run's own included: run_sweep read the store once, and it is not read again.
    ran = {t.trial_id for t in done.ran}
    text, failed = run_report(done.results.to_pandas(), ran, spec.search, store_path, terminal_width(), args.quiet)
    print(text)
    return EXIT_TRIALS_FAILED if failed else EXIT_OK


def _interrupted(why: str, tally: str, store_path: str, cluster: str | None) -> int:
    up = f" (once the cluster is up again: `raybench cluster up {cluster}`)" if cluster else ""
    print(f"interrupted ({why}); {tally}; finished trials are stored in {store_path}; run the same command again to "
          f"resume{up}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _trial(args) -> int:
    from raybench.drivers import executors
    from raybench.drivers.api import read_results, with_prepared_data
    from raybench.drivers.trial import run_trial

    spec = load_checked(args.sweep)
    trials = plan(spec, source=args.sweep, store_path=args.store or spec.store)
    chosen = matching(trials, args.id)
    if not chosen:
        print(f"{args.sweep}: no trial with id or index {args.id!r}; see `raybench plan {args.sweep}`",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    cuda_snapshot.check(chosen, args.sweep)
    store_path = args.store or spec.store
    chosen = with_prepared_data(chosen, store_path, source=args.sweep)
    row = run_trial(chosen[0].payload, spec.name, store_path, "torchrun", executors.get("torchrun"))
    rows = read_results(store_path, spec.name)
    print(results_table(rows[rows.trial_id == row["trial_id"]], width=terminal_width()))
    return EXIT_OK if row["status"] == "ok" else EXIT_TRIALS_FAILED


def _report(args) -> int:
    return cli_results.report(args)


def _best(args) -> int:
    from raybench.reports.best import best_report, read_rows, resolve_source

    if args.emit_sweep and not args.predict:
        print("raybench best --emit-sweep: only with --predict (it writes the trials whose predicted choice is in "
              "doubt)", file=sys.stderr)
        return EXIT_BAD_INPUT
    for flag, value in (("--gpu", args.gpu), ("--json", args.json)):
        if value and not args.predict:  # measured rows know their own GPU; the table has no JSON form
            print(f"raybench best {flag}: only with --predict", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.predict:
        if not args.source.endswith((".yaml", ".yml")):
            print(f"raybench best --predict: {args.source} is not a sweep file; --predict needs the sweep YAML "
                  "(its trials and the rehearsals `raybench rehearse` stored)", file=sys.stderr)
            return EXIT_BAD_INPUT
        # The GPU whose memory the rehearsals must fit in (estimate.gpu), as `rehearse --gpu`.
        spec = cli_rehearse.for_gpu(load_checked(args.source), args.gpu, "raybench best")
        return cli_rehearse.best_predicted(args, spec)

    store_path, sweep = resolve_source(args.source, args.sweep)
    if args.store:  # a sweep run with `run SWEEP --store DIR` has its rows there
        if store_path == args.source:
            print(f"raybench best --store {args.store}: {args.source} is a store already; give one store",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        if not Path(args.store).is_dir():
            print(f"raybench best --store {args.store}: not a directory; give the store `run` wrote the sweep's "
                  "rows to", file=sys.stderr)
            return EXIT_BAD_INPUT
        store_path = args.store
    rows = read_rows(store_path, sweep)
    print(best_report(rows, by=args.by, metric=args.metric, mode=args.mode, axis=args.axis,
                      max_mem_gib=args.max_mem_gib, source=args.source))
    return EXIT_OK if (rows.status == "ok").any() else EXIT_TRIALS_FAILED


def _slurm_submit(args) -> int:

    extra = [flag for flag, on in (("--rerun", args.rerun), ("--keep-invalid", args.keep_invalid)) if on]
    if args.signal_time is not None and not args.requeue:
        raise ConfigError("slurm options", [Problem("--signal-time", args.signal_time,
                                                    "only with --requeue (add --requeue, or leave it out)")])
    signal_s = (args.signal_time or requeue.DEFAULT_SIGNAL_S) if args.requeue else None
    job_id, job_dir = slurm.submit(args.sweep, cli_cluster.slurm_options(args), args.store, extra,
                                   requeue_signal_s=signal_s, check=cli_cluster.submit_check(args),
                                   problems=cli_cluster.tolerance_problems(args.tolerance))
    print(f"submitted job {job_id}; script, log and token in {job_dir}", flush=True)
    if not args.wait:
        return EXIT_OK
    # Requeued, the job is pending again between allocations: say so, so a long wait explains itself.
    code = slurm.sweep_exit_code(job_id, job_dir, on_state=(
        (lambda state: print(f"job {job_id}: {state}", flush=True)) if args.requeue else None))
    print("\n".join([*slurm.sweep_report(job_dir), f"job {job_id} finished: the sweep exited {code}; log: "
                                                   f"{sorted(job_dir.glob('slurm-*.out'))[-1]}"]))
    return code


def _add_slurm_parsers(sub) -> None:
    slurm = sub.add_parser("slurm", help="run a sweep as one SLURM job").add_subparsers(
        dest="slurm_command", required=True, parser_class=_Parser)
    p = slurm.add_parser("submit", help="allocation → Ray cluster → sweep → results → exit (one job)")
    p.add_argument("sweep")
    cli_cluster.add_slurm_options(p)
    p.add_argument("--store", help="result store directory, on a filesystem every node sees")
    p.add_argument("--rerun", action="store_true", help="run trials again even if stored as ok")
    p.add_argument("--keep-invalid", action="store_true", help="record impossible grid points as invalid rows")
    p.add_argument("--wait", action="store_true", help="wait for the job (across its requeues); exit with the "
                                                       "sweep's exit code")
    p.add_argument("--requeue", action="store_true",
                   help="requeue the job until the sweep is done: before its time limit (and when preempted) the job "
                        "stores the trials in flight as interrupted and runs the rest in its next allocation")
    p.add_argument("--signal-time", type=int, metavar="SECONDS",
                   help=f"with --requeue: seconds before the time limit at which the job requeues itself (sbatch "
                        f"--signal=B:USR1@SECONDS; default {requeue.DEFAULT_SIGNAL_S})")
    p.add_argument("--no-check", action="store_true", help="skip the pre-flight of every node before the sweep "
                                                           "(`raybench cluster check`'s, its rows in --store)")
    cli_cluster.add_verdict_options(p)
    p.set_defaults(func=_slurm_submit)

    cli_cluster.add_parsers(sub, _Parser)  # cluster up, status, check, down


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
    p.add_argument("--store", help="result store whose measured peaks calibrate the estimate (default: the sweep's)")
    p.set_defaults(func=_plan)

    p = sub.add_parser("estimate", help="per-trial memory (params/grads/optimizer/activations) and step-time guess")
    p.add_argument("sweep")
    p.add_argument("--store", help="result store whose measured peaks calibrate the estimate (default: the sweep's)")
    p.add_argument("--keep-invalid", action="store_true", help="list impossible grid points as invalid")
    p.add_argument("--json", action="store_true", help="one JSON object per trial instead of a table")
    p.set_defaults(func=_estimate)

    cli_rehearse.add_parser(sub)  # rehearse

    p = sub.add_parser("calibrate", help="measure this device for the rehearsal (matmul and bandwidth efficiency, "
                       "launch cost, allocator reserve) and store its profile; `rehearse` prices it with that")
    p.add_argument("--store", default="./raybench-results", help="result store to keep the profile in "
                   "(STORE/calibration/, one per device type; default ./raybench-results)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when visible, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer shapes, smaller buffers, shorter budgets")
    p.add_argument("--json", action="store_true", help="the profile as one JSON object")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("run", help="run a sweep on an embedded local Ray, or on --address")
    p.add_argument("sweep")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="existing Ray cluster (ray://… or host:port); default: private local Ray")
    where.add_argument("--cluster", metavar="NAME", help="a cluster started by `raybench cluster up NAME`")
    p.add_argument("--store", help="result store directory (overrides the sweep's store)")
    p.add_argument("--keep-invalid", action="store_true", help="record impossible grid points as invalid rows")
    p.add_argument("--rerun", action="store_true", help="run trials again even if stored as ok")
    p.add_argument("--quiet", action="store_true", help="batch jobs: no progress lines or table, only trials not ok "
                   "and the tally. Default: a live view on a terminal, one line per finished trial otherwise")
    p.add_argument("--verbose", action="store_true", help="show Ray and worker logs")
    # Passed by a one-shot SLURM job's payload (slurm._run_command): its sweep's driver runs in a child (split_run).
    p.add_argument("--slurm-job", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)

    p = sub.add_parser("trial", help="run one planned trial under plain torchrun (no Ray)")
    p.add_argument("sweep")
    p.add_argument("id", help="trial id, config id, or plan index")
    p.add_argument("--store", help="result store directory (overrides the sweep's store)")
    p.set_defaults(func=_trial)

    p = sub.add_parser("report", help="stored results as a table, or a Markdown/HTML/PNG report with figures")
    p.add_argument("store", nargs="?", default="./raybench-results")
    p.add_argument("--sweep", help="only this sweep")
    p.add_argument("--all-attempts", action="store_true", help="every attempt, not only the latest per trial")
    cli_results.add_report_options(p)
    p.set_defaults(func=_report)
    cli_results.add_parsers(sub)  # compare, export
    cli_store.add_parsers(sub)  # query, compact
    cli_example_data.add_parsers(sub)  # example-data

    p = sub.add_parser("best", help="best configuration (or best value of one axis) per GPU type and model")
    p.add_argument("source", nargs="?", default="./raybench-results", help="result store, or a sweep file")
    p.add_argument("--sweep", help="only this sweep (default: the sweep file's, or every sweep in the store)")
    p.add_argument("--by", default="gpu_name", help="group by this result column (gpu_name; CPU rows: 'cpu')")
    p.add_argument("--metric", default="tok_per_s_per_device", help="rank by this result column")
    p.add_argument("--mode", choices=["max", "min"], help="default: inferred from the metric's name")
    p.add_argument("--axis", help="best value of this config field per group and model, e.g. train.ac_ratio; with "
                   "--predict also fields that vary together, comma-separated: train.strategy,train.tp_size")
    p.add_argument("--max-mem-gib", type=float, help="only configurations whose mean peak memory per device "
                   "(GPU reserved, CPU RSS) is at most this")
    p.add_argument("--predict", action="store_true", help="before running: the best --axis value (default "
                   "train.ac_ratio) per group from the sweep's rehearsals (`raybench rehearse SWEEP` first)")
    p.add_argument("--store", help="with a sweep file: the store holding its rows, or with --predict its "
                   "rehearsals (default: the sweep's)")
    p.add_argument("--gpu", help="with --predict: the GPU whose memory they must fit (default: estimate.gpu)")
    p.add_argument("--json", action="store_true", help="with --predict: one JSON object per group (the figures, "
                   "their intervals, the values in doubt)")
    p.add_argument("--emit-sweep", metavar="PATH", help="with --predict: write the trials whose choice may flip "
                   "inside the prediction intervals as a short sweep (few steps, every one run) to PATH")
    p.set_defaults(func=_best)
    _add_slurm_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # `run` may run the same command in a child (split_run)
    try:
        return args.func(args)
    except ConfigError as err:
        print(err.report(), file=sys.stderr)
        return EXIT_BAD_INPUT
    except SlurmError as err:
        print(f"raybench: {err}", file=sys.stderr)
        return err.exit_code
    except StoreWriteError as err:  # a full disk, a quota: the sweep stopped, since every later row would be lost
        print(f"raybench: {err}\nEvery row stored before is intact. Make room there and run the same command "
              "again: a sweep runs only the trials not stored as ok.", file=sys.stderr)
        return EXIT_TRIALS_FAILED


if __name__ == "__main__":
    sys.exit(main())
