"""`raybench rehearse SWEEP` (hooked into raybench.cli.main): each configuration's step traced on this machine's
CPUs, in plan order, on --jobs worker processes. Exit codes as main's: 0 every configuration rehearsed (a trial
the trace cannot run falls back to its analytic estimate, and counts), 1 a worker process died and some were not,
2 bad input (nothing rehearsed or written), 130 Ctrl-C (what finished is stored)."""

from __future__ import annotations

import json
import sys

from raybench.planning.plan import load_checked, matching, plan
from raybench.reports.tables import rehearsal_report
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.hardware import gpu_labels, known_gpu

EXIT_OK, EXIT_NOT_ALL_REHEARSED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_parser(sub) -> None:
    p = sub.add_parser("rehearse", help="trace each trial's step at its full world size on this machine's CPUs "
                       "(fake tensors and ranks): memory by category, communication, predicted step time")
    p.add_argument("sweep")
    p.add_argument("--trial", help="only this trial (trial id, config id, or plan index)")
    p.add_argument("--store", help="result store: its all-reduce probes give the bus bandwidth, and the rehearsals "
                   "are kept there for `raybench estimate` (default: the sweep's)")
    p.add_argument("--gpu", help="GPU to predict for (default: the sweep's estimate.gpu), e.g. 'H100 SXM': step "
                   "times, and the memory fits (and train.loss auto) are judged on")
    p.add_argument("--busbw", type=float, metavar="GBPS", help="bus bandwidth of the cluster's collectives, GB/s "
                   "(nccl-tests' busbw; default: the sweep's estimate.busbw_gbps, else the store's probe, else "
                   "nominal links)")
    p.add_argument("--full-depth", action="store_true", help="trace every decoder block instead of extrapolating "
                   "a deep model from shallow ones (slower; the two agree: docs/rehearse.md)")
    p.add_argument("--jobs", type=int, metavar="N", help="worker processes: the configurations that share traces "
                   "go to one worker; rows are printed in plan order and equal one process's (default: one per CPU "
                   "this process may use; 1: in this process, the quicker where other work keeps the CPUs busy)")
    p.add_argument("--json", action="store_true", help="one JSON object per rehearsed configuration")
    p.set_defaults(func=_rehearse)


def for_gpu(spec, gpu: str | None, command: str):
    """The sweep with estimate.gpu set to a command's --gpu; a GPU the hardware table lacks is bad input, named with
    the ones it has (as `validate` names a sweep's unknown estimate.gpu)."""
    if not gpu:
        return spec
    if not known_gpu(gpu):
        raise ConfigError(command, [Problem("--gpu", gpu, f"unknown GPU; use one of {', '.join(gpu_labels())}")])
    return spec.model_copy(update={"estimate": spec.estimate.model_copy(update={"gpu": gpu})})


def _rehearse(args) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("raybench rehearse", [Problem(
            "--jobs", args.jobs, "the number of worker processes must be at least 1 (1: rehearse in this process; "
                                 "leave --jobs out for one per CPU this process may use)")])
    from raybench.rehearse.workers import WorkersLost, default_jobs, rehearse_sweep

    # The plan judges fits (and train.loss auto) on this GPU's memory, as `best --predict --gpu` does.
    spec = for_gpu(load_checked(args.sweep), args.gpu, "raybench rehearse")
    store_path = args.store or spec.store
    trials = plan(spec, source=args.sweep, store_path=store_path)
    if args.trial is not None:
        trials = matching(trials, args.trial)
        if not trials:
            print(f"{args.sweep}: no trial with id or index {args.trial!r} (--trial); see `raybench plan "
                  f"{args.sweep}`", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.busbw is not None and not 0 < args.busbw <= 100_000:
        print(f"--busbw {args.busbw}: a bus bandwidth in GB/s, above 0 and at most 100000 (e.g. nccl-tests' "
              "all_reduce busbw of the cluster)", file=sys.stderr)
        return EXIT_BAD_INPUT
    rows, lost = [], None
    # A second pass: a full-loss trial that train.loss auto chose by its estimate, and that its rehearsal now
    # says does not fit, is planned chunked from here on (planning/loss_choice.py): rehearse that trial too.
    for _ in range(2):
        found = rehearse_sweep(spec, trials, store_path, args.gpu, args.busbw, args.full_depth,
                               args.jobs or default_jobs())
        try:
            for row in found:
                rows.append(row)
                if args.json:
                    print(json.dumps(row, sort_keys=True), flush=True)
        except WorkersLost as err:
            lost = err
        except KeyboardInterrupt:
            print(f"raybench rehearse: interrupted; the rehearsals finished are stored in {store_path}/rehearsals",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            found.close()  # stops the worker processes, whatever ended the loop
        trials = [] if lost else _changed(trials, plan(spec, source=args.sweep, store_path=store_path))
        if not trials:
            break
    if not args.json:
        print(rehearsal_report(rows, store_path, args.sweep))
    if lost:
        print(f"raybench rehearse: {lost}", file=sys.stderr)
        return EXIT_NOT_ALL_REHEARSED
    return EXIT_OK


def _changed(rehearsed: list, replanned: list) -> list:
    """The replanned trials at the indices just rehearsed whose configuration the new rehearsals changed."""
    ids = {t.index: t.config_id for t in rehearsed}
    return [t for t in replanned if t.index in ids and t.config_id != ids[t.index]]


def best_predicted(args, spec) -> int:
    """`best SWEEP --predict`: the predicted choice per group, where it could flip, and (--emit-sweep) the
    short sweep of the trials in doubt."""
    from raybench.reports import prediction

    axis = args.axis or "train.ac_ratio"
    found = prediction.predict(spec, args.source, args.store or spec.store, axis)
    # A rehearsal stored before rehearsals kept their GPU (None) is taken for the sweep's own GPU, unless --gpu asks
    # for another.
    other = {cid: gpu for cid, gpu in found.priced_for_other_gpu.items() if gpu is not None or args.gpu}
    if other or found.unrehearsed:
        gpu = spec.estimate.gpu
        why = [f"{len(other)} rehearsal(s) priced for "
               f"{', '.join(sorted({g or 'a GPU not recorded' for g in other.values()}))}"] if other else []
        if found.unrehearsed:  # a configuration can change with the GPU (train.loss auto): a new one has none yet
            why.append(f"{len(found.unrehearsed)} trial(s) with none: " + "; ".join(
                f"{tid} {values}" for tid, values in found.unrehearsed.items()))
        print(f"raybench best --predict: {args.source} is not rehearsed for {gpu} ({'; '.join(why)}): run "
              f"`raybench rehearse {args.source} --gpu '{gpu}'` first", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        for result in found.results:
            print(json.dumps({**result, "priced_with": found.priced_with}, sort_keys=True, default=str))
    else:
        print(prediction.prediction_text(found, axis))
    if found.stale:
        print(found.stale, file=sys.stderr)
    if args.emit_sweep:
        print(prediction.write_settle_sweep(spec, found.results, args.emit_sweep, axis), file=sys.stderr)
    return EXIT_OK
