#!/usr/bin/env bash
# One GPU machine's measurements for docs/results/gpu-<date>.md, in stages, each under its own time limit so a
# hang in one stage costs only that stage. Run from the project root on a machine with one CUDA GPU:
#   bench/gpu_truth.sh OUT_DIR STAGE...     stages: env calibrate overhead validate seed000 seed000-one sac rehearse recheck
#                                           snapshot ddp-liger tests
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

for stage in "$@"; do
  echo "== $(date -u +%FT%TZ) stage $stage" | tee -a "$log"
  case $stage in
    env)
      nvidia-smi -q > "$out/nvidia-smi.txt"
      nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit,driver_version --format=csv
      python3 -c 'import importlib.metadata as m
for p in ["torch","ray","transformers","peft","deepspeed","optuna","pyarrow","bitsandbytes","liger-kernel","triton","flash-attn"]:
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
    # ddp + Liger (needs the Liger wheel): the rehearsal traces it since 2026-11-26 (26.17 GiB, 0.170 s on an
    # H100, docs/results/rehearse-2026-11-26.md §9); no GPU has run it. Its row lands in gpu-validate.parquet.
    ddp-liger) timeout -k 10 240 python3 -m raybench trial bench/sweeps/gpu-validate.yaml 9f29bd997b04e189 --store "$store" ;;
    # Every GPU test runs whatever another one does (no -x): each outcome is a measurement; -rA prints what the
    # passing ones printed (the compiled-block byte counts, CUDA against the CPU rehearsal).
    tests) timeout -k 10 480 python3 -m pytest tests/gpu -m gpu -q -rA -p no:cacheprovider --timeout=120 ;;
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
    cols = ["trial_id", "axis_values_json", "status", "tok_per_s_per_device", "mfu", "peak_alloc_gib", "est_peak_gib", "compile_s",
            "step_time_p50_s", "message"]
    df = table.select([c for c in cols if c in table.column_names]).to_pandas()
    df["message"] = df["message"].fillna("").str.slice(0, 160)
    print(f"-- {sweep}: {len(df)} rows\n{df.to_string()}")
PY
