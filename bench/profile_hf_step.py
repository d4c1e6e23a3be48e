"""Where a step's time goes on each rank of the same shape, through raybench's loop and through the hf stack.

    .venv/bin/python bench/profile_hf_step.py [--steps 30] [--warmup 5] [--rounds 1] [--variants raybench,hf,...]
        [--profiler none|cprofile|torch] [--out DIR]

The shape is bench/same_shape_hf.py's (tiny Llama, LoRA r8, fp32, DDP over 2 gloo ranks, micro-batch 2 x
grad-accum 2, 64 tokens per row), on its identical-records data: every micro-batch is the same batch, so the two
paths' first losses compare exactly. Each variant is one torchrun launch of 2 ranks running the trial's worker
(raybench.runtime.worker.run, the same code Ray Train's workers call) with clocks wrapped around the library
functions a step goes through, reading both the wall clock and the process's CPU clock (time.process_time):
CPU time is the work a rank does, wall minus CPU its waiting (for the other rank in a collective, or for a
core). Wrapping a function costs a few clock reads (microseconds), against steps of tens of milliseconds.

Per step and rank it records, for the hf stack: the batches' fetch and collation (Trainer.get_batch_samples, with
its gather of the step's token count across ranks), the forward (the DDP module's forward: PEFT, the model and
TRL's fused LM head), TRL's metric gathers (Accelerator.gather_for_metrics: 4 all-gathers per micro-batch),
the backward (Accelerator.backward, DDP's gradient all-reduce on the last micro-batch), clipping, the optimizer
step and zero_grad, and the remainder of the step (the Trainer's loop and callbacks, PEFT/accelerate glue; of
it, timed apart, the Trainer's per-micro-batch floating_point_ops and model.train()); for raybench's loop its
own phase clock (data, forward, backward, optimizer). Also: the LoRA A checksum at the first forward. Variants:

    raybench           raybench's loop (train.finetune lora)
    hf                 the hf stack (sweeps/stacks/hf_sft.py) as same_shape_hf.py runs it (HF_SAME_SHAPE: no
                       activation checkpointing, like raybench's loop)
    hf-ac              + SFTConfig activation_checkpointing: true, SFTConfig's own default (gradient_checkpointing)
    hf-no-unused       + SFTConfig ddp_find_unused_parameters: false
    hf-no-avg-tokens   + SFTConfig average_tokens_across_devices: false (no token-count gather per step)
    hf-no-metrics      TRL's metric gathers replaced by the local value (no SFTConfig key does this; a patch
                       here, to measure what they cost): the loss and the gradients are unchanged

Prints a table per variant (mean wall ms per item, its share of the step, CPU ms; both ranks), the first
micro-batch and first-step loss check across variants, a table over all rounds, and one JSON line. --profiler
also writes rank 0's cProfile (CPU clock) or torch.profiler report to OUT/r<round>-<variant>/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# The hf variants run same_shape_hf.HF_SAME_SHAPE (activation_checkpointing false) plus these SFTConfig keys.
VARIANTS = {
    "raybench": ("raybench", {}),
    "hf-ac": ("hf", {"activation_checkpointing": True}),  # SFTConfig's own default
    "hf": ("hf", {}),
    "hf-no-unused": ("hf", {"ddp_find_unused_parameters": False}),
    "hf-no-avg-tokens": ("hf", {"average_tokens_across_devices": False}),
    "hf-no-metrics": ("hf", {}),
}
HF_ITEMS = ("data", "forward", "metric_gathers", "loss_glue", "backward", "clip", "optimizer", "zero_grad",
            "remainder")
RAYBENCH_ITEMS = ("data", "forward", "backward", "optimizer", "remainder")
# Parts of the hf step's remainder, timed apart: the Trainer's per-micro-batch FLOP count (it walks every
# parameter of the model) and its model.train() (it walks every module), both for each micro-batch.
HF_PARTS = ("flops_count", "train_mode")


# ---------------------------------------------------------------------------------------------- driver side

def payload_file(variant: str, steps: int, warmup: int, model: Path, data: Path, root: Path) -> Path:
    """The variant's one-trial sweep, planned and tokenized as `raybench run` does it, as torchrun's payload
    file (a rank opens the tokenized data; it never tokenizes)."""
    import yaml
    from same_shape_hf import sweep

    from raybench.data.prepare import with_prepared_data
    from raybench.planning.plan import plan
    from raybench.spec.load import load_sweep

    kind, overrides = VARIANTS[variant]
    spec = sweep(kind, steps, model, data, overrides)
    spec["train"]["warmup_steps"] = warmup
    path = root / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(spec))
    (trial,) = with_prepared_data(plan(load_sweep(path), source=str(path)), str(root / "store"),
                             progress=lambda line: None, source=str(path))
    out = root / f"{variant}.payload.json"
    out.write_text(json.dumps(trial.payload.to_dict()))
    return out


def launch(variant: str, payload: Path, out: Path, profiler: str = "none") -> dict:
    """Two ranks under torchrun, each writing its clocks to out/rank{r}.json."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--worker", variant, str(payload), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PROFILE_HF_STEP": profiler}
    log = out / "torchrun.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if code != 0:
        raise SystemExit(f"{variant}: torchrun exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def summarize(variant: str, ranks: dict, warmup: int) -> dict:
    """Median ms per item over the timed steps, and its share of the median step, per rank."""
    items = RAYBENCH_ITEMS if VARIANTS[variant][0] == "raybench" else HF_ITEMS
    out = {}
    for rank, rec in ranks.items():
        steps = rec["steps"][warmup:]
        step_ms = [s["step"] * 1e3 for s in steps]
        p50 = statistics.median(step_ms)
        out[rank] = {"step_p50_ms": p50, "step_mean_ms": statistics.fmean(step_ms),
                     "items_mean_ms": {k: statistics.fmean(s[k] * 1e3 for s in steps) for k in items},
                     "cpu_mean_ms": {k: statistics.fmean(s.get(f"cpu:{k}", 0.0) * 1e3 for s in steps)
                                     for k in items + HF_PARTS},
                     "step_cpu_mean_ms": statistics.fmean(s["cpu:step"] * 1e3 for s in steps),
                     "loss_first": rec["loss_first"], "tokens_per_step": rec["tokens_per_step"],
                     "counts": rec.get("counts", {}), "threads": rec["threads"], "lora_a_sum": rec["lora_a_sum"],
                     "losses": rec["losses"][:4]}
    return out


def model_view(batch: dict) -> dict:
    """What the model's loss reads of a batch: a causal LM predicts labels[:, 1:] (position 0's label, the token
    itself in TRL's batches and -100 in raybench's, is never a target)."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"),
            "targets": [row[1:] for row in batch["labels"]]}


def print_table(variant: str, summary: dict) -> None:
    items = RAYBENCH_ITEMS if VARIANTS[variant][0] == "raybench" else HF_ITEMS
    print(f"\n{variant}: step p50 {summary[0]['step_p50_ms']:.1f} ms (rank 0), {summary[1]['step_p50_ms']:.1f} ms "
          f"(rank 1); first-step loss {summary[0]['loss_first']!r}")
    print("| item | rank 0 wall ms | share | CPU ms | rank 1 wall ms | share | CPU ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in items:
        cells = []
        for r in (0, 1):
            ms, mean = summary[r]["items_mean_ms"][k], summary[r]["step_mean_ms"]
            cells += [f"{ms:.1f}", f"{100 * ms / mean:.0f}%", f"{summary[r]['cpu_mean_ms'][k]:.1f}"]
        print(f"| {k} | " + " | ".join(cells) + " |")
    if VARIANTS[variant][0] == "hf":
        print("| of remainder: " + ", ".join(HF_PARTS) + " (CPU ms) | " + " | ".join(
            "- | - | " + " + ".join(f"{summary[r]['cpu_mean_ms'][k]:.1f}" for k in HF_PARTS) for r in (0, 1)) + " |")
    print("| step (mean) | " + " | ".join(f"{summary[r]['step_mean_ms']:.1f} | 100% | "
                                          f"{summary[r]['step_cpu_mean_ms']:.1f}" for r in (0, 1)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variant order (reversed every other round)")
    parser.add_argument("--variants", default="raybench,hf,hf-ac,hf-no-metrics,hf-no-unused,hf-no-avg-tokens")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profiler", choices=("none", "cprofile", "torch"), default="none",
                        help="also profile rank 0's steps (slows them: for where the time goes, not how long a "
                             "step takes); writes OUT/r<round>-<variant>/rank0.<profiler>.txt")
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "PAYLOAD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    from same_shape_hf import write_inputs

    root = args.out or Path(tempfile.mkdtemp(prefix="profile-hf-step-"))
    root.mkdir(parents=True, exist_ok=True)
    model, data = write_inputs(root)
    names = args.variants.split(",")
    payloads = {v: payload_file(v, args.steps, args.warmup, model, data, root) for v in names}
    results = []
    for round_ in range(args.rounds):
        for variant in (names if round_ % 2 == 0 else names[::-1]):
            load = os.getloadavg()[0]
            ranks = launch(variant, payloads[variant], root / f"r{round_}-{variant}", args.profiler)
            summary = summarize(variant, ranks, args.warmup)
            print_table(variant, summary)
            results.append({"round": round_, "variant": variant, "load_1m": load, "summary": summary,
                            "first_batch": ranks[0]["first_batch"]})
    batches = {json.dumps(model_view(r.pop("first_batch")), sort_keys=True) for r in results}
    print(f"\nfirst micro-batch identical across variants (input_ids, attention_mask, labels[:, 1:]): "
          f"{len(batches) == 1}")
    losses = {r["variant"]: r["summary"][0]["loss_first"] for r in results}
    print(f"first-step losses: {losses}; largest difference {max(losses.values()) - min(losses.values()):.3g}")
    print("LoRA A checksums as drawn (rank 0):", {r["variant"]: r["summary"][0]["lora_a_sum"] for r in results})
    print_overall(names, results)
    print(json.dumps({"steps": args.steps, "warmup": args.warmup, "results": results}))


def print_overall(names: list[str], results: list[dict]) -> None:
    """Per variant over every round and both ranks: the median of the runs' step p50 (wall), and the mean CPU ms
    per step and per item."""
    print("\n| variant | runs | step p50 wall ms (median of runs) | CPU ms/step | " + " | ".join(
        f"{k} CPU" for k in HF_ITEMS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(HF_ITEMS))
    for variant in names:
        runs = [r["summary"][rank] for r in results if r["variant"] == variant for rank in (0, 1)]
        cells = [f"{statistics.fmean(s['cpu_mean_ms'][k] for s in runs):.1f}" if k in runs[0]["cpu_mean_ms"]
                 else "-" for k in HF_ITEMS]
        print(f"| {variant} | {len(runs) // 2} | {statistics.median(s['step_p50_ms'] for s in runs):.1f} | "
              f"{statistics.fmean(s['step_cpu_mean_ms'] for s in runs):.1f} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------------------------- rank side

class Clocks:
    """Seconds per item within the current step, and the finished steps."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)  # item -> wall seconds, "cpu:" + item -> CPU seconds
        self.counts: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []
        self.first_batch: dict | None = None
        self.profiler = None

    def profile(self, on: bool) -> None:
        """cProfile or torch.profiler over the steps of rank 0, when asked (PROFILE_HF_STEP)."""
        kind = os.environ.get("PROFILE_HF_STEP", "none")
        if kind == "none" or os.environ.get("RANK") != "0":
            return
        if on and self.profiler is None:
            if kind == "cprofile":
                import cProfile

                self.profiler = cProfile.Profile(time.process_time)  # CPU seconds: waits in collectives are not
                self.profiler.enable()
            else:
                import torch

                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.start()
        elif not on and self.profiler is not None:
            self.stop_profiler()

    def stop_profiler(self) -> str | None:
        """Stop the profiler once; its report (None if it ran in no step)."""
        if self.profiler is None or getattr(self, "report", None) is not None:
            return getattr(self, "report", None)
        if hasattr(self.profiler, "disable"):
            import io
            import pstats

            self.profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(self.profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(80)
            self.report = text.getvalue()
        else:
            self.profiler.stop()
            averages = self.profiler.key_averages()
            self.report = (averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n"
                           + averages.table(sort_by="cpu_time_total", row_limit=60))
        return self.report

    def wrap(self, owner, name: str, item: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[item] += time.perf_counter() - start
                self.current["cpu:" + item] += time.process_time() - cpu
                self.counts[item] += 1

        setattr(owner, name, timed)

    def end_step(self, step_s: float, step_cpu_s: float, items: tuple[str, ...]) -> None:
        known = {k: self.current.get(k, 0.0) for k in items if k != "remainder"}
        cpu = {f"cpu:{k}": self.current.get(f"cpu:{k}", 0.0) for k in items if k != "remainder"}
        parts = {f"{p}{k}": self.current.get(f"{p}{k}", 0.0) for k in HF_PARTS for p in ("", "cpu:")}
        self.steps.append({**known, **cpu, "remainder": step_s - sum(known.values()), "step": step_s,
                           "cpu:remainder": step_cpu_s - sum(cpu.values()), "cpu:step": step_cpu_s, **parts})
        self.current = defaultdict(float)

    def keep_first_batch(self, batch: dict) -> None:
        if self.first_batch is None:
            self.first_batch = {k: batch[k].tolist() for k in ("input_ids", "labels", "attention_mask")
                                if k in batch}


def hook_raybench(clocks: Clocks) -> None:
    """raybench's loop times its own phases (bench.PhaseClock): keep each timed step's."""
    from raybench.runtime import bench

    state = {"timed": False}
    original_loop, original_totals, original_to_device = bench.timed_loop, bench.PhaseClock.totals_s, bench._to_device
    original_start, original_mark, original_step = bench.PhaseClock.start, bench.PhaseClock.mark, bench.train_step

    def start(self):
        self.cpu_marks = [("", time.process_time())]
        original_start(self)

    def mark(self, phase):
        original_mark(self, phase)
        self.cpu_marks.append((phase, time.process_time()))

    def train_step(*args, **kwargs):
        cpu = time.process_time()
        try:
            return original_step(*args, **kwargs)
        finally:
            if state["timed"]:
                state["step_cpu"].append(time.process_time() - cpu)

    def timed_loop(*args, **kwargs):
        state["timed"], state["step_cpu"] = True, []
        clocks.profile(True)
        try:
            record = original_loop(*args, **kwargs)
        finally:
            state["timed"] = False
            clocks.profile(False)
        # The phases are host clock readings between marks; the step time is the loop's own (train_step + sync).
        for step, cpu, phases in zip(record.step_times_s, state["step_cpu"], clocks.steps):
            phases["remainder"] = step - sum(phases[k] for k in ("data", "forward", "backward", "optimizer"))
            phases["step"] = step
            phases["cpu:remainder"] = cpu - sum(phases[f"cpu:{k}"] for k in ("data", "forward", "backward",
                                                                              "optimizer"))
            phases["cpu:step"] = cpu
        clocks.losses = record.losses
        clocks.tokens = record.tokens
        return record

    def totals_s(self):
        totals = original_totals(self)
        if state["timed"]:
            cpu = dict.fromkeys(totals, 0.0)
            for (_, before), (phase, after) in zip(self.cpu_marks, self.cpu_marks[1:]):
                cpu[phase] += after - before
            clocks.steps.append({**totals, **{f"cpu:{k}": v for k, v in cpu.items()}})
        return totals

    def to_device(batch, device):
        if state["timed"]:
            clocks.keep_first_batch(batch)
        return original_to_device(batch, device)

    bench.timed_loop, bench.PhaseClock.totals_s, bench._to_device = timed_loop, totals_s, to_device
    bench.PhaseClock.start, bench.PhaseClock.mark, bench.train_step = start, mark, train_step


def hook_hf(clocks: Clocks, no_metrics: bool) -> None:
    """Clocks around the library functions an hf step goes through; the step is the probe's."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer
    from trl import SFTTrainer

    from raybench.runtime.probe import StepProbe

    if no_metrics:
        # TRL gathers its entropy/accuracy/token-count metrics from every rank, per micro-batch; keep the local
        # value instead (only the logged metrics change).
        Accelerator.gather_for_metrics = lambda self, input_data, use_gather_object=False: input_data
    import transformers.modeling_utils

    # Counted only (its time is inside the forward and the backward): activation checkpointing at work.
    clocks.wrap(transformers.modeling_utils, "checkpoint", "ac_checkpoint")
    clocks.wrap(Trainer, "get_batch_samples", "data")
    clocks.wrap(DistributedDataParallel, "forward", "forward")
    clocks.wrap(Accelerator, "gather_for_metrics", "metric_gathers")
    clocks.wrap(SFTTrainer, "compute_loss", "compute_loss")
    clocks.wrap(Accelerator, "backward", "backward")
    clocks.wrap(Accelerator, "clip_grad_norm_", "clip")
    clocks.wrap(AcceleratedOptimizer, "step", "optimizer")
    clocks.wrap(DistributedDataParallel, "zero_grad", "zero_grad")
    clocks.wrap(Trainer, "floating_point_ops", "flops_count")
    clocks.wrap(DistributedDataParallel, "train", "train_mode")
    original_prepare = Trainer._prepare_inputs

    def prepare_inputs(self, inputs):
        clocks.keep_first_batch(inputs)
        return original_prepare(self, inputs)

    Trainer._prepare_inputs = prepare_inputs
    original_start, original_step = StepProbe.start, StepProbe.step

    def step(self, *args, **kwargs):
        original_step(self, *args, **kwargs)
        cpu_now = time.process_time()
        c = clocks.current
        # compute_loss holds the forward and the gathers: its rest is TRL's loss arithmetic and bookkeeping.
        for prefix in ("", "cpu:"):
            c[prefix + "loss_glue"] = (c.pop(prefix + "compute_loss", 0.0) - c.get(prefix + "forward", 0.0)
                                       - c.get(prefix + "metric_gathers", 0.0))
        clocks.end_step(self.record.step_times_s[-1], cpu_now - clocks.step_cpu_start, HF_ITEMS)
        clocks.step_cpu_start = cpu_now
        if len(clocks.steps) == clocks.total_steps:
            clocks.profile(False)
        clocks.losses, clocks.tokens = self.record.losses, self.record.tokens

    def start(self):
        clocks.current = defaultdict(float)  # the build's forward-free setup is not a step
        original_start(self)
        clocks.step_cpu_start = time.process_time()
        clocks.profile(True)

    StepProbe.start, StepProbe.step = start, step


def hook_lora_init(clocks: Clocks) -> None:
    """Keep a checksum of the LoRA A matrices as the first forward sees them (B starts at zero, so the first loss
    does not depend on A; every later one does)."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.forward

    def forward(self, *args, **kwargs):
        if getattr(clocks, "lora_a_sum", None) is None:
            clocks.lora_a_sum = float(sum(p.detach().double().sum() for n, p in self.module.named_parameters()
                                          if "lora_A" in n))
        return original(self, *args, **kwargs)

    DistributedDataParallel.forward = forward


def worker(variant: str, payload_path: str, out: str) -> None:
    import torch.distributed as dist

    from raybench.spec.payload import TrialPayload
    import torch

    from raybench.runtime import worker as rank_worker

    clocks = Clocks()
    payload = TrialPayload.from_dict(json.loads(Path(payload_path).read_text()))
    clocks.total_steps = payload.config.train.steps
    if VARIANTS[variant][0] == "raybench":
        hook_raybench(clocks)
    else:
        hook_hf(clocks, no_metrics=variant == "hf-no-metrics")
    hook_lora_init(clocks)  # after hook_hf: its forward clock then includes this check's first call only
    rank_worker.run(payload)
    rank = dist.get_rank()
    report = clocks.stop_profiler()
    if report is not None:
        Path(out, f"rank0.{os.environ['PROFILE_HF_STEP']}.txt").write_text(report)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "steps": clocks.steps, "loss_first": clocks.losses[0], "losses": clocks.losses,
        "tokens_per_step": clocks.tokens[0], "first_batch": clocks.first_batch, "counts": dict(clocks.counts),
        "threads": torch.get_num_threads(), "lora_a_sum": getattr(clocks, "lora_a_sum", None)}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
