#!/usr/bin/env bash
# The GPU check, one script, <= 10 minutes on one H200 by its step limits (the whole run took 106 s on 2026-12-04,
# before the resident step; docs/scaling.md, "GPU check"):
#   1. preflight: the device exists (fails fast, naming it, when CUDA is asked for and absent) and a
#      1-process nccl group starts and all-reduces on it;
#   2. equality: calibrate() on a small random CLIP, CPU path vs --device cuda --offload-blocks in a
#      1-process nccl group (featcal's collectives forced on), within float32 round-off;
#   3. speed: benchmarks/calibration_speed.py on a full-size random CLIP ViT-B/32 (768 wide, 12 blocks),
#      8 experts x 256 examples per task, --device cuda --offload-blocks --process-group nccl: the forward
#      floor and a full calibrate(), each in a fresh process (wall time, peak device memory, peak RSS);
#   3b. resident: the same calibrate() with the experts loaded on the device, no offloading (issue #40's
#      resident path: used in place, no per-block copy), into $GPU_CHECK_OUT/resident.json;
#   4. report: a table, and the figures as JSON in $GPU_CHECK_OUT/gpu_check.json. A calibrate / floor
#      ratio below 1 is reported as a measurement error (exit 1), never as a result.
#
#   benchmarks/gpu_check.sh                                               # the GPU run
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=small GPU_CHECK_THREADS=1 benchmarks/gpu_check.sh   # CPU dry run (gloo for nccl)
#
# Settings (environment): GPU_CHECK_DEVICE (cuda), GPU_CHECK_SIZE (vit-b32 | small), GPU_CHECK_TASKS (8),
# GPU_CHECK_EXAMPLES (256), GPU_CHECK_BATCH (32), GPU_CHECK_REPEATS (1), GPU_CHECK_THREADS (CPU threads per
# process; default min(nproc, 8)), GPU_CHECK_OUT (runs/gpu-check), PYTHON (.venv/bin/python if present, else
# python3), GPU_CHECK_TIMEOUTS ("45 120 285 20 120": seconds for the preflight, equality, speed, report and resident
# steps; 590 s in all).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${GPU_CHECK_DEVICE:-cuda}
SIZE=${GPU_CHECK_SIZE:-vit-b32}
TASKS=${GPU_CHECK_TASKS:-8}
EXAMPLES=${GPU_CHECK_EXAMPLES:-256}
BATCH=${GPU_CHECK_BATCH:-32}
REPEATS=${GPU_CHECK_REPEATS:-1}
NPROC=$(nproc 2>/dev/null || echo 1)
THREADS=${GPU_CHECK_THREADS:-$(( NPROC < 8 ? NPROC : 8 ))}
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
read -r T_PRE T_EQ T_SPEED T_REPORT T_RESIDENT <<< "${GPU_CHECK_TIMEOUTS:-45 120 285 20 120}"
T_RESIDENT=${T_RESIDENT:-120}
case "$DEVICE" in
  cuda*) BACKEND=nccl ;;
  cpu) BACKEND=gloo ;;
  *) echo "gpu_check: FAILED: GPU_CHECK_DEVICE must be cuda, cuda:N or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TQDM_DISABLE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -f "$OUT"/{preflight,equal,speed,resident,gpu_check}.json
START=$SECONDS

echo "gpu_check: device $DEVICE, size $SIZE, $TASKS experts x $EXAMPLES examples, batch $BATCH, $REPEATS repeat(s),"
echo "           $THREADS CPU thread(s), process group $BACKEND, step limits ${T_PRE}/${T_EQ}/${T_SPEED}/${T_RESIDENT}/${T_REPORT} s, out $OUT"
if [[ $BACKEND != nccl ]]; then
  echo "gpu_check: CPU DRY RUN: gloo stands in for nccl and the CPU for the GPU (no device figures)"
fi

step() {  # step NAME LIMIT CMD...: run CMD under a hard time limit (its whole process group), fail clearly
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "gpu_check: FAILED: step '$name' ran past its ${limit} s limit (after $(( SECONDS - START )) s in all)" >&2
    exit 3
  elif [[ $rc -ne 0 ]]; then
    echo "gpu_check: FAILED: step '$name' exited $rc" >&2
    exit "$rc"
  fi
  echo "-- $name: $(( SECONDS - t0 )) s"
}

step preflight "$T_PRE" "$PYTHON" benchmarks/gpu_check.py preflight --device "$DEVICE" --backend "$BACKEND" \
  --out "$OUT/preflight.json"
step equality "$T_EQ" "$PYTHON" benchmarks/gpu_check.py equal --device "$DEVICE" --backend "$BACKEND" \
  --out "$OUT/equal.json"
step speed "$T_SPEED" "$PYTHON" benchmarks/calibration_speed.py --preset "$SIZE" --tasks "$TASKS" \
  --examples "$EXAMPLES" --batch-size "$BATCH" --repeats "$REPEATS" --threads "$THREADS" --device "$DEVICE" \
  --offload-blocks --process-group "$BACKEND" --skip-straightforward --out "$OUT/speed.json"
# the resident path (issue #40): experts loaded on the device, no offloading; featcal.json-style placement
# "resident" (calibration/engine/expert_placement.py). Its wall time against the offloaded speed step above.
step resident "$T_RESIDENT" "$PYTHON" benchmarks/calibration_speed.py --preset "$SIZE" --tasks "$TASKS" \
  --examples "$EXAMPLES" --batch-size "$BATCH" --repeats "$REPEATS" --threads "$THREADS" --device "$DEVICE" \
  --expert-source device --skip-straightforward --out "$OUT/resident.json"
step report "$T_REPORT" "$PYTHON" benchmarks/gpu_check.py report --dir "$OUT" --elapsed "$(( SECONDS - START ))"
echo
echo "gpu_check: done in $(( SECONDS - START )) s"
