#!/usr/bin/env bash
# One GPU machine's measurements for docs/results/gpu-<date>.md, in stages, each under its own time limit so a
# hang in one stage costs only that stage. Run from the project root on a machine with one CUDA GPU:
#   bench/gpu_truth.sh OUT_DIR STAGE...     stages: env calibrate overhead validate seed000 seed000-one sac rehearse recheck
#                                           snapshot ddp-liger tests stacks probe hf-check speed data leftovers
#                                           zero zero-offload compiled-ac
# Writes OUT_DIR/log.txt, OUT_DIR/<sweep>.parquet (every stored row of each sweep, one file) and, for `env`,
# nvidia-smi -q and package versions. RAYBENCH_GPU_STORE (default /tmp/rb-gpu-store) holds the store, so a
# rerun of a stage resumes: rows stored ok are not run again; RAYBENCH_GPU_SEED names a folder of earlier
# OUT_DIR Parquet files to resume from.
set -uo pipefail
out=$1; shift
store=${RAYBENCH_GPU_STORE:-/tmp/rb-gpu-store}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
log=$out/log.txt

# Rows from an earlier machine (this script's own OUT_DIR/<sweep>.parquet files) seed the store, so a stage
# cut short on one machine resumes on the next.
for f in "${RAYBENCH_GPU_SEED:-/nonexistent}"/*.parquet; do
  [ -e "$f" ] || continue
  sweep=$(basename "$f" .parquet)
  mkdir -p "$store/sweep=$sweep" && cp "$f" "$store/sweep=$sweep/earlier-machine.parquet"
done

run_sweep() {  # sweep file, seconds allowed
  echo "== $(date -u +%FT%TZ) raybench run $1 (limit $2 s)"
  timeout -k 30 "$2" python3 -m raybench run "$1" --store "$store" --quiet
  local rc=$?
  # The time says whether a 124 (the limit) came during the trials or after the summary was printed.
  echo "== exit $rc at $(date -u +%FT%TZ)"
}

# A stage's sweep, given SIGTERM 90 s before the stage's end (deadline, in bash's SECONDS): the rows stored are
# kept and Ray is shut down within timeout's 30 s grace, leaving 60 s to what the stage does after it.
stage_sweep() {  # sweep name, deadline
  local limit=$(($2 - SECONDS - 90))
  if [ "$limit" -gt 0 ]; then  # (timeout 0 would mean no limit)
    echo "== $(date -u +%FT%TZ) raybench run bench/sweeps/$1.yaml (limit $limit s)"
    timeout -k 30 "$limit" python3 -m raybench run "bench/sweeps/$1.yaml" --store "$store" --quiet
    echo "== exit $? at $(date -u +%FT%TZ)"
  else
    echo "== $(date -u +%FT%TZ) not run (no time left): raybench run bench/sweeps/$1.yaml"
  fi
}

# One sub-step of a stage under its own limit, cut to what is left of the stage's budget (deadline, in bash's
# SECONDS) less 20 s, so that a hang ends the step and the final summary still writes the rows.
step() {  # seconds allowed, deadline, command...
  local limit=$1 deadline=$2; shift 2
  local left=$((deadline - SECONDS - 20))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then echo "== $(date -u +%FT%TZ) not run (no time left): $*"; return; fi
  echo "== $(date -u +%FT%TZ) $* (limit $limit s)"
  timeout -k 10 "$limit" "$@"
  echo "== exit $? at $(date -u +%FT%TZ)"
}

# GPU round 2 (issue 46): the round's model directory and chat data, written here (bench/stack_round_data.py), then
# seed 000's LoRA shape through raybench's loop (A), TRL's SFTTrainer (B) and Lightning (C) in the order A B C C B A,
# each a fresh `raybench trial` row (a second run of a trial is a new attempt: OUT_DIR/<sweep>.parquet keeps both,
# told apart by started_at). RAYBENCH_GPU_STACKS_TWIN=1 runs the CPU twins (tiny model, bf16 too) through the same
# commands; RAYBENCH_GPU_STACKS_S bounds the stage (default 480 s); RAYBENCH_GPU_STACKS_ORDER replaces the order
# (round 6: "raybench hf hf raybench").
stacks_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_STACKS_S:-480})) data=bench/sweeps/example-data/stack-round suffix=""
  local make=(--preset llama-3.2-1b --dtype bf16 --device cuda --chats 20000) run_s=150  # TRL took 83-90 s on an H100
  if [ -n "${RAYBENCH_GPU_STACKS_TWIN:-}" ]; then  # a shared 2-core machine took up to 72 s a run
    data=$data-twin suffix=-cpu make=(--preset tiny --dtype bf16 --device cpu --chats 2000) run_s=180
  fi
  step 120 "$deadline" python3 bench/stack_round_data.py "$data" "${make[@]}"
  for stack in ${RAYBENCH_GPU_STACKS_ORDER:-raybench hf lightning lightning hf raybench}; do
    step "$run_s" "$deadline" python3 -m raybench trial "bench/sweeps/gpu-stack-$stack$suffix.yaml" 0 --store "$store"
  done
}

# GPU round 3 (speed, issue 46): bench/sweeps/gpu-speed-1gpu.yaml (FP8 tensorwise and rowwise, Liger, micro-batch
# 12 and the full loss beside the bf16 points of seed 000's LoRA and the 1B full fine-tune, 30 steps, compiled, each
# point profiled for 3 steps) on the warm pool; then `raybench losses` over each of the three axes (OUT_DIR/
# losses-<axis>.txt) and the fastest point of each fine-tune with its profile (OUT_DIR/speed-best.txt).
# Budget (H100; the whole round, `env speed`, in 9 minutes): pip install of .whl ~25 s and env ~10 s (rounds 1-2);
# the stage RAYBENCH_GPU_SPEED_S (default 480 s): Ray's start ~25 s, then ~45-65 s a point: ~22 s outside the
# worker (a compiled trial on the pool first compiles a miniature of itself: trial_wall_s less worker_wall_s was
# 21-25 s in gpu-h100-recheck 2026-11-26, 9.6 s for the tiny model on the CPU here), ~4 s of build, 6-16 s of
# compile (gpu-sac-1b, gpu-seed000; FP8's casts add graphs), 33 steps at 0.19-0.49 s (30 trained, 3 profiled: these
# shapes in gpu-2026-11-22/ and their rehearsal), a few seconds reading the profile, and ~15 s of new actors after
# each Liger point (Liger patches transformers: its group is replaced). So 6-8 of the 11 points, in the sweep's
# order, within the sweep's limit (the stage less 90 s); the rest are not run, and a later machine runs them from
# this one's rows (RAYBENCH_GPU_SEED). Comparisons and summary ~10 s; the final summary ~10 s. ~8.7 minutes in all.
# RAYBENCH_GPU_SPEED_TWIN=1 validates and plans the GPU sweep, then runs the CPU twin (gpu-speed-1gpu-cpu.yaml)
# through the same commands.
speed_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_SPEED_S:-480})) sweep=gpu-speed-1gpu
  if [ -n "${RAYBENCH_GPU_SPEED_TWIN:-}" ]; then
    step 60 "$deadline" python3 -m raybench validate "bench/sweeps/$sweep.yaml"
    step 60 "$deadline" python3 -m raybench plan "bench/sweeps/$sweep.yaml" --store "$store"
    sweep=$sweep-cpu
  fi
  stage_sweep "$sweep" "$deadline"  # leaves 60 s to the comparisons and the summary
  for pair in train.fp8=off train.liger=false train.loss=full; do
    step 30 "$deadline" python3 -m raybench losses "$store" --sweep "$sweep" --axis "${pair%%=*}" \
      --baseline "${pair#*=}" | tee "$out/losses-${pair%%=*}.txt"
  done
  step 30 "$deadline" python3 bench/speed_best.py "$store" --sweep "$sweep" | tee "$out/speed-best.txt"
}

# GPU round 4 (real data on CUDA, issue 46): the round's model directory and chat data (bench/stack_round_data.py, as
# the stacks stage writes them), then bench/sweeps/gpu-data-1gpu.yaml (seed 000's LoRA, eager: packed sdpa with its
# dense mask, padded rows, packed flex_attention with a block mask, 0 and 4 loader workers, padded to seq_len) on the
# warm pool; then `raybench losses` over each axis (OUT_DIR/losses-<axis>.txt), the summary (OUT_DIR/data-round.txt,
# bench/data_round.py) and, if time is left, the flex-against-sdpa GPU test (loss and gradients, fp32).
# Budget (H100; the whole round, `env data`, in ~8 minutes): pip install of .whl ~25 s and env ~10 s; the stage
# RAYBENCH_GPU_DATA_S (default 420 s): the 1B's directory and 20,000 chats 13 s (round 2), Ray's start ~25 s, the
# chats tokenized once ~10 s, then ~35-60 s a point (eager: no compile of a miniature or of the model; the 1B read
# from its directory, 30 steps at ~0.2-0.35 s, flex's first step compiling its kernels), so the six points in the
# sweep's limit (the stage less 90 s); comparisons, summary and test in the last 90 s; the final summary ~10 s.
# RAYBENCH_GPU_DATA_TWIN=1 runs the CPU twin (gpu-data-1gpu-cpu.yaml: a tiny model, 2,000 chats, no flex point)
# through the same commands (its GPU sweep's 1B directory is not written on a CPU: tests/unit/test_gpu_data_round.py
# validates and plans that sweep).
data_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_DATA_S:-420})) sweep=gpu-data-1gpu data=bench/sweeps/example-data/stack-round
  local make=(--preset llama-3.2-1b --dtype bf16 --device cuda --chats 20000)
  if [ -n "${RAYBENCH_GPU_DATA_TWIN:-}" ]; then
    sweep=$sweep-cpu data=$data-twin make=(--preset tiny --dtype bf16 --device cpu --chats 2000)
  fi
  step 120 "$deadline" python3 bench/stack_round_data.py "$data" "${make[@]}"
  stage_sweep "$sweep" "$deadline"  # leaves 60 s to the comparisons, the summary and the test
  for pair in model.attn_implementation=sdpa data.num_workers=2 data.pad_to=seq_len data.packing=true; do
    step 30 "$deadline" python3 -m raybench losses "$store" --sweep "$sweep" --axis "${pair%%=*}" \
      --baseline "${pair#*=}" | tee "$out/losses-${pair%%=*}.txt"
  done
  step 30 "$deadline" python3 bench/data_round.py "$store" --sweep "$sweep" | tee "$out/data-round.txt"
  if [ -z "${RAYBENCH_GPU_DATA_TWIN:-}" ]; then
    step 60 "$deadline" python3 -m pytest tests/gpu/test_gpu_flex_attention.py -m gpu -q -rA -p no:cacheprovider \
      -k loss_and_gradients
  fi
}

# GPU round 5 (leftovers, issue 46), the most wanted first: bench/sweeps/gpu-leftovers-1gpu.yaml on the warm pool (the
# public 8B LoRA point, its dropout-0 point, seed 000's LoRA with the chunked loss, the full loss and dropout 0.1,
# eager); `raybench losses` over the loss and the dropout (OUT_DIR/losses-<axis>.txt) and the summary (OUT_DIR/
# leftovers-round.txt, bench/leftovers_round.py); then ddp + Liger and ZeRO-3 with optimizer and parameter offload,
# each gpu-validate's own trial outside Ray (rows in gpu-validate.parquet); then the GPU tests with the time left, the
# files holding tests not yet passed on a GPU first (tests/unit/test_gpu_leftovers_round.py checks the list is all of
# tests/gpu).
# Budget (H100; the whole round, `env leftovers`, in 9 minutes): pip install of .whl ~25 s and env ~10 s; the stage
# RAYBENCH_GPU_LEFTOVERS_S (default 480 s):
#   the sweep, limit the stage less 90 s (~390 s), ~190 s expected: Ray's start ~25 s; point 0 ~60-90 s (the 8B built
#   from meta on the GPU, random values drawn there, no download: ~5-15 s, the 1B's build is 0.1-1.3 s on an H100;
#   then 4 steps of 16 micro-batches at 10.5-16.6 s: the public run's and the rehearsal's); point 1 ~25-35 s (the 8B
#   built again, 16 steps at ~0.9 s); points 2-4 ~15-25 s each (eager 1B LoRA, 30 steps at ~0.3 s: round 2's A and
#   seed000-one took 14-18 s in the worker); the summary and Ray's shutdown ~10 s;
#   the two comparisons and the summary: 30 s each, ~5 s each;
#   ddp + Liger: 120 s, ~40 s (a `raybench trial` of the 1B, 20 steps of 2 x 1024: seed000-one's 27 s outside the
#   worker and a few seconds in it);
#   ZeRO-3 parameter offload: 180 s, ~80-120 s (DeepSpeed's CPU Adam JIT-built once per machine, g++ and ninja,
#   ~30-60 s; 20 steps at ~1.1 s, 2026-11-22);
#   the GPU tests: what is left less 20 s, ~100-150 s (all of them took ~450 s on 2026-11-26): pytest gets SIGINT 10 s
#   before that, so it prints what passed, failed and did not run; the rest run on a later machine.
# The final summary ~10 s: ~525 s in all, whatever a trial does. RAYBENCH_GPU_LEFTOVERS_TWIN=1 validates and plans the
# GPU sweep, then runs the CPU twin (gpu-leftovers-1gpu-cpu.yaml) through the same sweep, comparisons and summary;
# the two gpu-validate trials need CUDA and are not run, the GPU tests skip themselves without it.
leftovers_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_LEFTOVERS_S:-480})) sweep=gpu-leftovers-1gpu
  local tests=(tests/gpu/test_gpu_techniques.py tests/gpu/test_gpu_pool.py tests/gpu/test_gpu_snapshot.py
               tests/gpu/test_gpu_flex_attention.py tests/gpu/test_gpu_calibrate.py tests/gpu/test_gpu_rehearse.py)
  if [ -n "${RAYBENCH_GPU_LEFTOVERS_TWIN:-}" ]; then
    step 60 "$deadline" python3 -m raybench validate "bench/sweeps/$sweep.yaml"
    step 60 "$deadline" python3 -m raybench plan "bench/sweeps/$sweep.yaml" --store "$store"
    sweep=$sweep-cpu
  fi
  stage_sweep "$sweep" "$deadline"  # leaves 60 s at least to what follows
  for pair in train.loss=full train.lora.dropout=0.0; do
    step 30 "$deadline" python3 -m raybench losses "$store" --sweep "$sweep" --axis "${pair%%=*}" \
      --baseline "${pair#*=}" | tee "$out/losses-${pair%%=*}.txt"
  done
  step 30 "$deadline" python3 bench/leftovers_round.py "$store" --sweep "$sweep" | tee "$out/leftovers-round.txt"
  # gpu-validate's ddp + Liger (the `ddp-liger` stage's trial) and ZeRO-3 with optimizer and parameter offload.
  for trial in 9f29bd997b04e189:120 f6ba128e27da327d:180; do
    if [ -n "${RAYBENCH_GPU_LEFTOVERS_TWIN:-}" ]; then
      echo "== not run on a CPU (CUDA only): raybench trial bench/sweeps/gpu-validate.yaml ${trial%%:*}"
    else
      step "${trial#*:}" "$deadline" python3 -m raybench trial bench/sweeps/gpu-validate.yaml "${trial%%:*}" \
        --store "$store"
    fi
  done
  local left=$((deadline - SECONDS - 30))
  if [ "$left" -gt 0 ]; then
    step 480 "$deadline" timeout -s INT "$left" python3 -m pytest "${tests[@]}" -m gpu -q -rA \
      -p no:cacheprovider --timeout=120
  else
    echo "== $(date -u +%FT%TZ) not run (no time left): the GPU tests"
  fi
}

# GPU round 8 (ZeRO on one GPU): bench/sweeps/gpu-zero-1gpu.yaml (FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on Llama-3.2-1B)
# on the warm pool, then bench/zero_round.py's summary against the predictions committed before it ran
# (OUT_DIR/zero-round.txt). Budget RAYBENCH_GPU_ZERO_S (default 300 s): Ray's start ~25 s and three points of
# 20 steps of 2 x 8k tokens (0.40-0.42 s predicted) with their builds. RAYBENCH_GPU_ZERO_TWIN=1 validates and plans
# the GPU sweep, then runs the CPU twin (gpu-zero-1gpu-cpu.yaml) through the same commands.
zero_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_ZERO_S:-300})) sweep=gpu-zero-1gpu
  if [ -n "${RAYBENCH_GPU_ZERO_TWIN:-}" ]; then
    step 60 "$deadline" python3 -m raybench validate "bench/sweeps/$sweep.yaml"
    step 60 "$deadline" python3 -m raybench plan "bench/sweeps/$sweep.yaml" --store "$store"
    sweep=$sweep-cpu
  fi
  stage_sweep "$sweep" "$deadline"
  step 30 "$deadline" python3 bench/zero_round.py "$store" --sweep "$sweep" | tee "$out/zero-round.txt"
}

# GPU round 7 (compiled memory under activation checkpointing): bench/sweeps/gpu-compiled-ac-1gpu.yaml (op-level AC,
# block AC at 1 and at 1/2, each eager then compiled, Llama-3.2-1B at 2 x 8k tokens) on the warm pool, then the
# same sweep again (--rerun: each pair A B, then A B again) with the time left but 60 s, then
# bench/compiled_ac_round.py's summary against the predictions committed before it ran (OUT_DIR/compiled-ac-round.txt).
# Budget RAYBENCH_GPU_COMPILED_AC_S (default 480 s): Ray's start ~25 s, a point's build ~5 s, compile ~30-60 s
# (compiled points), 12 steps of ~0.4-0.6 s predicted: the first pass in about 4-5 minutes.
# RAYBENCH_GPU_COMPILED_AC_TWIN=1 validates and plans the GPU sweep, then runs the CPU twin
# (gpu-compiled-ac-1gpu-cpu.yaml) through the same commands.
compiled_ac_stage() {
  local deadline=$((SECONDS + ${RAYBENCH_GPU_COMPILED_AC_S:-480})) sweep=gpu-compiled-ac-1gpu
  if [ -n "${RAYBENCH_GPU_COMPILED_AC_TWIN:-}" ]; then
    step 60 "$deadline" python3 -m raybench validate "bench/sweeps/$sweep.yaml"
    step 60 "$deadline" python3 -m raybench plan "bench/sweeps/$sweep.yaml" --store "$store"
    sweep=$sweep-cpu
  fi
  stage_sweep "$sweep" "$deadline"
  step 600 "$((deadline - 40))" python3 -m raybench run "bench/sweeps/$sweep.yaml" --store "$store" --rerun --quiet
  step 30 "$deadline" python3 bench/compiled_ac_round.py "$store" --sweep "$sweep" | tee "$out/compiled-ac-round.txt"
}

for stage in "$@"; do
  echo "== $(date -u +%FT%TZ) stage $stage" | tee -a "$log"
  case $stage in
    env)
      nvidia-smi -q > "$out/nvidia-smi.txt"
      nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit,driver_version --format=csv
      python3 -c 'import importlib.metadata as m
for p in ["torch","ray","transformers","peft","accelerate","trl","datasets","lightning","deepspeed","optuna","pyarrow","bitsandbytes","liger-kernel","torchao","triton","flash-attn"]:
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "not installed")
import torch; print("cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name())' ;;
    # The device profile `rehearse` prices trials with (OUT_DIR/calibration/*.json): bench/rehearse_validate.py
    # --profile re-rehearses the committed rows under it.
    calibrate) timeout -k 10 240 python3 -m raybench calibrate --device cuda --store "$store" \
                 && mkdir -p "$out/calibration" && cp "$store"/calibration/*.json "$out/calibration/" ;;
    overhead) timeout -k 10 240 python3 bench/harness_overhead.py --device cuda --rounds 20 --steps 8 --seq-len 2048 \
                --micro-batch 4 ;;
    validate) run_sweep bench/sweeps/gpu-validate.yaml 360 ;;
    seed000) run_sweep bench/sweeps/gpu-seed000-1gpu.yaml 190 ;;
    # Seed 000's recipe point alone (plan index 1: ac 0, eager, no Liger), outside Ray: one row in a minute.
    seed000-one) timeout -k 10 240 python3 -m raybench trial bench/sweeps/gpu-seed000-1gpu.yaml 1 --store "$store" ;;
    sac) run_sweep bench/sweeps/gpu-sac-1b.yaml ${RAYBENCH_GPU_SAC_S:-540} ;;
    rehearse) run_sweep bench/sweeps/gpu-rehearse-check.yaml ${RAYBENCH_GPU_REHEARSE_S:-540} ;;
    recheck) run_sweep bench/sweeps/gpu-h100-recheck.yaml 330 ;;  # 6 trials took 239 s on an H100 (2026-11-26)
    # What holds DDP's peak (docs/results/rehearse-2026-11-26.md): the allocator's history of three steps, and
    # the tensors live at the peak by allocation site (OUT_DIR/snapshot/*-peak.json, printed to the log).
    snapshot) RAYBENCH_CUDA_MEMORY_SNAPSHOT=$out/snapshot timeout -k 10 240 \
                python3 -m raybench trial bench/sweeps/gpu-ddp-snapshot.yaml 0 --store "$store"
              cat "$out"/snapshot/*-peak.json ;;
    # Round 8's offload half (GPU round 8: ZeRO offload's reserved peak waits on it): gpu-validate's ZeRO-2 and
    # ZeRO-3 trials with offload, each beside its twin without (plan indices 4 and 2, then 5 and 3), the allocator's
    # history of each and the tensors live at each one's peak by allocation site, DeepSpeed's lines among them
    # (OUT_DIR/zero-offload/*-peak.json, printed to the log). On 2026-11-22 the offloaded ones peaked higher (28.5
    # and 31.3 GiB allocated) than those without (25.4 and 25.7). The first offloaded trial JIT-builds DeepSpeed's
    # CPU Adam (142 s then, the trial included).
    zero-offload) for index in 4 2 5 3; do
                    RAYBENCH_CUDA_MEMORY_SNAPSHOT=$out/zero-offload timeout -k 10 200 \
                      python3 -m raybench trial bench/sweeps/gpu-validate.yaml "$index" --store "$store"
                  done
                  cat "$out"/zero-offload/*-peak.json ;;
    # ddp + Liger (needs the Liger wheel): the rehearsal traces it since 2026-11-26 (26.17 GiB, 0.170 s on an
    # H100, docs/results/rehearse-2026-11-26.md §9); no GPU has run it. Its row lands in gpu-validate.parquet.
    ddp-liger) timeout -k 10 240 python3 -m raybench trial bench/sweeps/gpu-validate.yaml 9f29bd997b04e189 --store "$store" ;;
    # Every GPU test runs whatever another one does (no -x): each outcome is a measurement; -rA prints what the
    # passing ones printed (the compiled-block byte counts, CUDA against the CPU rehearsal).
    stacks) stacks_stage ;;
    # Round 2's TRL B at 0.32x: its layers were checkpointed (transformers 5.17 has no activation_checkpointing, and
    # SFTConfig's gradient_checkpointing defaulted on; docs/results/trl-checkpointing-2026-11-28.md). What is left of
    # the gap after the fix: the checkpointing keys this machine's SFTConfig has, and the attention of TRL's one
    # flattened row (a dense square mask over 12,288 tokens) against six rows of 2,048, one layer.
    hf-check) python3 -c 'import dataclasses, transformers, trl; from trl import SFTConfig
keys = ("activation_checkpointing", "gradient_checkpointing")
print("transformers", transformers.__version__, "trl", trl.__version__, "SFTConfig defaults:",
      {f.name: f.default for f in dataclasses.fields(SFTConfig) if f.name in keys})'
              timeout -k 10 60 python3 bench/packed_row_attention.py --device cuda ;;
    # The probe's cost on CUDA (one synchronization per optimizer step): the tiny Llama with and without the probe,
    # A B B A per round, 16k tokens a step (CPU twin: RAYBENCH_GPU_STACKS_TWIN=1, a few small rounds).
    probe) if [ -n "${RAYBENCH_GPU_STACKS_TWIN:-}" ]; then
             timeout -k 10 120 python3 bench/probe_overhead.py --device cpu --rounds 2 --steps 5
           else
             timeout -k 10 75 python3 bench/probe_overhead.py --device cuda --rounds 10 --steps 20 --micro-batch 8 \
               --seq-len 2048
           fi ;;
    speed) speed_stage ;;
    data) data_stage ;;
    leftovers) leftovers_stage ;;
    zero) zero_stage ;;
    compiled-ac) compiled_ac_stage ;;
    tests) timeout -k 10 480 python3 -m pytest tests/gpu -m gpu -q -rA -p no:cacheprovider --timeout=120 ;;
    # Round 11: the pre-flight on this machine's GPUs against the table, and one NCCL group's transports (CPU twin:
    # tests/unit/test_gpu_preflight_round.py), then the pre-flight's GPU test.
    preflight) timeout -k 10 180 python3 bench/preflight_round.py "$out/preflight"
               timeout -k 10 60 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/unit/test_preflight.py ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac 2>&1 | tee -a "$log"
done

# One Parquet file per sweep (the store's own reader: schema evolution, every attempt), and a short summary.
python3 - "$store" "$out" <<'PY' 2>&1 | tee -a "$log"
import sys
import pyarrow.parquet as pq
from raybench.results import store
root, out = sys.argv[1], sys.argv[2]
for sweep_dir in sorted(store.Path(root).glob("sweep=*")):
    sweep = sweep_dir.name.removeprefix("sweep=")
    table = store.read_table(root, sweep, latest=False)
    pq.write_table(table, f"{out}/{sweep}.parquet")
    cols = ["started_at", "trial_id", "axis_values_json", "status", "tok_per_s_per_device", "mfu", "peak_alloc_gib",
            "est_peak_gib", "compile_s", "step_time_p50_s", "message"]
    # In the order they ran: a trial run twice (the stacks stage's two passes) shows as two attempts.
    df = table.select([c for c in cols if c in table.column_names]).to_pandas().sort_values("started_at")
    df["message"] = df["message"].fillna("").str.slice(0, 160)
    print(f"-- {sweep}: {len(df)} rows\n{df.to_string()}")
PY
