"""One trial: run it through an executor, turn the outcome (failure included) into a row, store the row.

A failed trial is a result row with a status and a one-line message, never an aborted sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from raybench.drivers.nodes import NodeLost
from raybench.planning import assessment
from raybench.results import store
from raybench.results.store import SCHEMA, flatten_config, json_column
from raybench.runtime import fingerprint, rank_progress
from raybench.spec.metrics import projection as metrics_projection
from raybench.spec.payload import TrialPayload
from raybench.spec.redact import ANSI_ESCAPE, without_secrets
from raybench.spec.schema import DataTaken, RankResult
from raybench.spec.stacks import kind
from raybench.spec.tokenized_data import CUT_LABEL_NOTE_FRAC

# interrupted: the sweep was stopped (SIGTERM at the end of an allocation, scancel, Ctrl-C) while the trial ran;
# no measurement is kept and the next run of the sweep runs it again (sweep.write_interrupted_rows).
STATUSES = ("ok", "oom", "error", "timeout", "invalid", "skipped", "interrupted")
# "ValueError: ...", and a qualified exception of any name ("torch._dynamo.exc.FailOnRecompileLimitHit: ...").
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)):?\s|^((?:[a-z_]\w*\.)+[A-Z]\w*):\s")
# "rank 1 was killed by signal SIGABRT (exit code -6); its last error line: ...": a rank (or a command) that died
# by a signal raises no exception; the executors write this line for it (signal_line).
SIGNAL_LINE = re.compile(r"^(rank \d+|the command .+?) was killed by signal \S+ \(exit code -\d+\)")
# CUDA OOM, and a host allocation refused under resources.memory_limit_gib (torch's CPU allocator, Python).
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory", "OOM", "can't allocate memory",
                "Cannot allocate memory", "MemoryError")
# A torch.distributed collective that outlived the process-group timeout is a hang, not a crash.
_TIMEOUT_MARKERS = ("Timed out waiting", "timed out after", "Watchdog caught collective operation timeout")
# Enough for a deep traceback and a log tail; rows stay small enough to scan by the hundred thousand.
ERROR_DETAIL_CHARS = 8000


def one_line_message(text: str, limit: int = 500) -> str:
    """The most telling line of an error text: its last 'SomeError: ...' line (or a signal's, SIGNAL_LINE), else
    its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    picked = max((i for i, line in enumerate(lines) if EXCEPTION_LINE.match(line) or SIGNAL_LINE.match(line)),
                 default=0)
    message = lines[picked]
    if message.endswith(":"):  # a heading ("Training failed due to worker errors:"): the reason comes next
        reason = next((line for line in lines[picked + 1:] if not line.endswith(":")), "")
        message = f"{message} {reason}".strip()
    return message[:limit]


def signal_line(who: str, signal_name: str, exit_code: int) -> str:
    """The message of a rank or command killed by a signal (SIGNAL_LINE): "rank 1 was killed by signal SIGABRT (exit
    code -6)"."""
    return f"{who} was killed by signal {signal_name} (exit code {exit_code})"


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, one-line message) of a failed trial; the message is the line that explains the status."""
    # Ray's dead-worker message lists guesses ("killed by the OOM killer", ...) after this phrase: they are
    # not findings, so they must not decide the status.
    text = error_text(exc).split("Some common causes include")[0]
    if isinstance(exc, NodeLost):  # its first line names the node; the text after it is Ray's own guesswork
        return "error", str(exc).splitlines()[0][:500]
    if isinstance(exc, TimeoutError):
        return "timeout", one_line_message(text)
    for status, markers in (("oom", _OOM_MARKERS), ("timeout", _TIMEOUT_MARKERS)):
        lines = [line.strip() for line in text.splitlines() if any(m in line for m in markers)]
        if lines:
            return status, lines[-1][:500]
    return "error", one_line_message(text)


def error_text(exc: BaseException) -> str:
    """A failure's whole text without secret values (removed before any cut, which could leave part of one)
    or terminal colours (Ray colours its frame headers)."""
    return without_secrets(ANSI_ESCAPE.sub("", f"{type(exc).__name__}: {exc}"))


def error_detail(exc: BaseException) -> str:
    """The end of a failed trial's error text: the remote traceback Ray carries, or torchrun's log tail."""
    return error_text(exc)[-ERROR_DETAIL_CHARS:]


def build_row(payload: TrialPayload, sweep: str, status: str, message: str, result: RankResult | None = None,
              started_at: datetime | None = None, ended_at: datetime | None = None,
              wall_s: float | None = None, executor: str | None = None, detail: str | None = None) -> dict:
    """A trial's result row: identity, config columns, what rank 0 returned (`result`: the metrics and where and
    with what they were measured; None for a failed trial; a provenance column outside the schema is an error)
    and what the plan derives from it."""
    config = payload.config.model_dump(mode="json")
    row = {
        "sweep": sweep,
        "trial_id": payload.trial_id,
        "config_id": payload.config_id,
        "repeat": payload.repeat,
        "status": status,
        "message": message,
        "error_detail": detail,
        "executor": executor,
        "started_at": started_at,
        "ended_at": ended_at or datetime.now(timezone.utc),
        "trial_wall_s": wall_s,
        **flatten_config(config),
        "stack_kind": payload.config.stack.kind,  # raybench's own loop leaves the section out of its dump
        "world_size": config["resources"]["workers"],
        "num_layers": payload.num_layers,
        "ac_blocks": list(payload.ac_blocks),
        "axis_values_json": json_column(payload.axis_values),
        "config_json": json_column(config),
        "env_json": json_column(result.env if result is not None else None),
        # Failed trials carry no worker fingerprint; the driver runs on the same system, so its label holds.
        "system": (result.system if result is not None else None) or fingerprint.system_label(),
    }
    if result is not None:
        row.update({k: v for k, v in _measured_columns(payload, result).items() if k not in row})
    plan = payload.projection
    if row.get("tok_per_s") and row.get("nonpad_tok_per_s") and row.get("tokens_per_step"):
        nonpad_fraction = row["nonpad_tok_per_s"] / row["tok_per_s"]  # the share of processed tokens that are real
        step_s = row["tokens_per_step"] / row["tok_per_s"]  # the throughput columns' time per step
        row.update(metrics_projection(step_s, row["tokens_per_step"], nonpad_fraction, row["world_size"],
                                      plan.dataset_tokens, plan.epochs, plan.total_steps))
    row.update(assessment.row_fields(payload.assessment, row))  # and, for ok rows, the estimate's error
    taken = _data_taken(payload, result)
    if payload.tokenized is not None and taken:  # what the tokens were, known before launch
        row.update(payload.tokenized.row_fields())
        if taken == "samples":  # the stack packed or padded them its own way
            row["packing_efficiency"] = None
    return row


def _measured_columns(payload: TrialPayload, result: RankResult) -> dict:
    """The result's metric, provenance and stack columns; a provenance column outside the schema is an error."""
    unknown = sorted(set(result.provenance) - set(SCHEMA.names))
    if unknown:  # a misspelled column must fail loudly, not become a null column
        raise ValueError(f"trial {payload.trial_id}: result columns outside the row schema: {unknown}")
    return {**dataclasses.asdict(result.metrics), **result.provenance, "stack_version": result.stack_version}


def _data_taken(payload: TrialPayload, result: RankResult | None) -> DataTaken | None:
    """What the trial took of raybench's tokenized data: what rank 0 said. A failed trial of raybench's own loop
    took its rows, as that loop always does; of a user's stack, nothing is known (runtime.stacks.measure.StackData:
    a stack trained on the data only where its entry took it from raybench)."""
    if result is not None:
        return result.data_taken
    return "rows" if kind(payload.config.stack.kind).own_loop else None


def run_trial(payload: TrialPayload, sweep: str, store_path: str, executor: str,
              execute: Callable[[TrialPayload], RankResult]) -> dict:
    """Execute one planned trial and store its row; never raises for a failure of the trial itself."""
    started_at = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    # Per-cluster measurements (the all-reduce probe) are cached next to the results they explain.
    payload = payload.replace(cache_dir=str(Path(store_path) / "_cache"))
    detail = None
    try:
        result, status, message = execute(payload), "ok", ""
        diverged = nonfinite_loss(result)
        if diverged:  # measured, but not a training anyone wants: never an ok row
            status, message = "error", diverged
    except Exception as exc:  # any failure of the benchmark becomes the row's status
        result = None
        (status, message), detail = classify(exc), error_detail(exc)
        # Slow or hung, from the ranks' marks (raybench's loop, and the stacks that run in its workers).
        if status == "timeout" and kind(payload.config.stack.kind).in_process:
            far = rank_progress.describe(rank_progress.read(payload.cache_dir, payload.trial_id),
                                         payload.config.resources.workers, time.time())
            message, detail = f"{message}; {far}"[:1000], f"{far}\n{detail}"
    rank_progress.clear(payload.cache_dir, payload.trial_id)
    row = build_row(payload, sweep, status, message, result, started_at, datetime.now(timezone.utc),
                    time.perf_counter() - t0, executor, detail)
    if status != "ok" and stopped_while_running(store_path, sweep, payload.trial_id, started_at):
        return row  # a failure the stop caused (ranks killed with the allocation): the `interrupted` row stands
    written = store.write_row(store_path, row)
    if status != "ok" and stopped_while_running(store_path, sweep, payload.trial_id, started_at):
        # The stop's row landed while this one was written. Each side looks again after its own write
        # (sweep.write_interrupted_rows too), so one of them always sees the other.
        written.unlink(missing_ok=True)
    return row


def stopped_while_running(store_path: str, sweep: str, trial_id: str, started_at: datetime) -> bool:
    """Whether the sweep driver stored this trial `interrupted` after this attempt started: the sweep was stopped
    (SIGTERM at the end of an allocation) while it ran. Its failure row, built later, would be the trial's latest
    row and hide that the stop, not the trial, ended it."""
    for path in store.trial_row_files(store_path, sweep, trial_id):
        stored = store.row_status(path)
        if stored["status"] == "interrupted" and stored["ended_at"] >= started_at:
            return True
    return False


def nonfinite_loss(result: RankResult) -> str | None:
    """Why a measured trial is an error all the same: a step's loss that is nan or infinite (None: every known loss
    is finite)."""
    losses = result.metrics.loss_by_step or []
    bad = [(step, loss) for step, loss in enumerate(losses) if loss is not None and not math.isfinite(loss)]
    if not bad:
        return None
    step, loss = bad[0]
    return (f"the loss is {loss} at step {step} ({len(bad)} of {len(losses)} steps not finite): a batch with no label "
            "tokens (data.overflow, data.loss_on), a learning rate too high (train.lr) or fp16 without "
            "train.grad_scaler")


def summary(row: dict) -> str:
    """One progress line for a finished trial (and what data.overflow cut, above CUT_LABEL_NOTE_FRAC)."""
    axes = json.loads(row["axis_values_json"] or "{}")
    where = " ".join(f"{k.split('.')[-1]}={v}" for k, v in axes.items())
    if row["status"] == "ok":
        per = "GPU" if row.get("device_type") == "cuda" else "worker"  # as the results table names it
        line = (f"{row['trial_id']} ok  {where}  {row['tok_per_s_per_device']:.0f} tok/s/{per}  "
                f"step p50 {row['step_time_p50_s'] * 1000:.0f} ms")
    else:
        line = f"{row['trial_id']} {row['status']}  {where}  {row['message']}"
    cut = row.get("label_tokens_cut_frac")
    if cut is not None and cut > CUT_LABEL_NOTE_FRAC:
        line += (f"  [data.overflow {row.get('data_overflow') or 'truncate'} cut {row['samples_cut']} samples, "
                 f"{cut:.1%} of label tokens]")
    return line
