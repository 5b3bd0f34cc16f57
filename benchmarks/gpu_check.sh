#!/usr/bin/env bash
# gpu_check.sh: the GPU proof-and-benchmark run of metrale-attn, as ONE command with a
# hard time budget (about 6 minutes of device time), everything written under $OUT.
#
#   1. environment (GPU, SMs, clocks, driver, CUDA, library versions) and the
#      device-to-device copy bandwidth every ratio is taken against   (gpu_env.py)
#   2. the GPU test suite: pytest -m gpu tests/test_gpu.py (cap 120 s)
#   3. compute-sanitizer memcheck, racecheck and initcheck on a small case of every
#      arm (a refusal is recorded, not fatal)                          (sanitize_cases.py)
#      Steps 2 and 3 overlap, and FlashInfer's JIT compile (baselines.py
#      flashinfer-prewarm) runs beside them: none of them is timed.
#   4. the benchmark sweep against the baselines                      (bench_decode.py)
#   5. summary: summary.md, and a short table printed LAST            (summarize.py)
#
# $OUT (default ./gpu_check_out) receives at most 8 files: summary.md,
# DATE_DEVICE_bench.{json,md,png}, DATE_DEVICE_arms.png and logs.tar.gz (every log).
# Each step has its own `timeout`; the benchmark's budget shrinks to what is left of
# GPU_CHECK_DEADLINE_S (default 360 s) so the whole run ends on time.
#
# On the device (the wheels of .whl/, from benchmarks/fetch_wheels.sh, carried along):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_check.sh
#
# Without a GPU: `bash benchmarks/gpu_check.sh --cpu` runs steps 1, 4 and 5 on the CPU
# backend simulator (a tiny sweep, no baselines, no sanitizer), same outputs.
#
# Environment knobs: OUT, PYTHON (default python3), GPU_CHECK_DEADLINE_S (360),
# PYTEST_TIMEOUT_S (120), PYTEST_WORKERS (6, if pytest-xdist is there),
# SANITIZE_TOOLS ("memcheck racecheck initcheck"), SANITIZE_TIMEOUT_S (60 each),
# FLASHINFER_JIT_CAP_S (150), BENCH_BUDGET_S (150 at most), BENCH_ARGS (extra
# bench_decode.py flags), KEEP_WORK=1 (keep the log folder; it is in logs.tar.gz anyway).
set -uo pipefail

MODE=gpu
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --cpu or nothing)" >&2; exit 2 ;;
  esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
PY=${PYTHON:-python3}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-360}
T0=$(date +%s)
STEPS=$WORK/steps.tsv
export PYTHONUNBUFFERED=1
# nvcc and compute-sanitizer; and the scripts of carried wheels (ninja, for FlashInfer's JIT).
[ -d /usr/local/cuda/bin ] && case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) export PATH="$PATH:/usr/local/cuda/bin" ;; esac
IFS=: read -r -a SITES <<<"${PYTHONPATH:-}"
for site in "${SITES[@]}"; do
  if [ -n "$site" ] && [ -d "$site/bin" ]; then export PATH="$PATH:$site/bin"; fi
done
: >"$STEPS"

elapsed() { echo $(( $(date +%s) - T0 )); }
# step NAME STATUS SECONDS DETAIL: one line of the step table (tab-separated).
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(echo "$4" | tr '\t\n' '  ' | cut -c1-400)" >>"$STEPS"; }
say() { echo "[gpu_check $(elapsed)s] $*"; }
clamp() { local v=$1 lo=$2 hi=$3; [ "$v" -lt "$lo" ] && v=$lo; [ "$v" -gt "$hi" ] && v=$hi; echo "$v"; }

say "mode=$MODE out=$OUT logs=$WORK deadline=${DEADLINE_S}s"

# -- 0. the package must import with its kernel sources --------------------------------------
# Run from the checkout without installing: metrale_attn finds kernels_cu/ beside itself.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
t=$(date +%s)
if "$PY" -c "import metrale_attn.kernels as k; k.read_source(k.COMMON_HEADER)" >"$WORK/install.log" 2>&1; then
  step install ok $(( $(date +%s) - t )) "metrale_attn imports from the checkout"
else
  step install FAIL $(( $(date +%s) - t )) "metrale_attn does not import: $(tail -n 1 "$WORK/install.log")"
fi

# -- 1. environment and copy bandwidth --------------------------------------------------------
t=$(date +%s)
CPUFLAG=(); [ "$MODE" = cpu ] && CPUFLAG=(--cpu)
if [ "$MODE" = gpu ]; then
  timeout 20 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
  timeout 20 nvidia-smi -q >"$WORK/nvidia-smi-q.txt" 2>&1
fi
timeout 90 "$PY" benchmarks/gpu_env.py --out "$WORK/env.json" "${CPUFLAG[@]}" >"$WORK/env.log" 2>&1
rc=$?
cat "$WORK/env.log"
if [ $rc -eq 0 ]; then
  step environment ok $(( $(date +%s) - t )) "$(grep '^copy bandwidth' "$WORK/env.log")"
else
  step environment FAIL $(( $(date +%s) - t )) "rc=$rc: $(tail -n 1 "$WORK/env.log")"
fi

# -- 2+3. GPU tests in the foreground; sanitizers and FlashInfer's JIT in the background ----------
# The sanitizer runs and the JIT prewarm only need correctness (or the CPU), so they overlap
# the test suite; nothing runs beside the benchmark, which needs the GPU to itself.
sanitize_chain() {
  local tool t log rc verdict status
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    t=$(date +%s)
    log="$WORK/sanitize_$tool.log"
    timeout -k 10 "${SANITIZE_TIMEOUT_S:-60}" "$SANITIZER" --tool "$tool" --error-exitcode 3 \
      --print-limit 20 "$PY" benchmarks/sanitize_cases.py </dev/null >"$log" 2>&1
    rc=$?
    verdict=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:' "$log" | tr '\n' ' ')
    case $rc in
      0) status=ok ;;
      3) status=ERRORS ;;
      124|137) status=TIMEOUT ;;
      1) status=WRONG ;;  # the cases ran but an output missed the correctness bar
      *) status=REFUSED ;;
    esac
    if grep -qiE 'device not supported|unable to (find|load|initialize)|not supported on this' "$log"; then
      status=REFUSED  # the sanitizer could not instrument this device or driver
    fi
    if [ "$status" = REFUSED ] || [ -z "$verdict" ]; then
      verdict="$verdict $(grep -v '^$' "$log" | tail -n 2 | tr '\n' ' ')"
    fi
    STEPS="$WORK/sanitize_steps.tsv" step "sanitize_$tool" "$status" $(( $(date +%s) - t )) "rc=$rc $verdict"
  done
}

FI_PID=''
SAN_PID=''
if [ "$MODE" = gpu ]; then
  FI_CAP=${FLASHINFER_JIT_CAP_S:-150}
  mkdir -p "$WORK/flashinfer"
  # Niced: its nvcc jobs (ninja runs ~30 at once over the 4 variants) would otherwise starve the
  # pytest workers of the 16 cores and push the GPU tests toward their cap; it gets the CPU the
  # tests leave, and all of it once they end.
  NICE=(); command -v nice >/dev/null 2>&1 && NICE=(nice -n 10)
  timeout $((FI_CAP + 60)) "${NICE[@]}" "$PY" benchmarks/baselines.py flashinfer-prewarm --timeout-s "$FI_CAP" \
    --out "$WORK/flashinfer_status.json" --log-dir "$WORK/flashinfer" </dev/null >"$WORK/flashinfer_prewarm.log" 2>&1 &
  FI_PID=$!
  SANITIZER=$(command -v compute-sanitizer)
  for candidate in /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
    if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then SANITIZER=$candidate; fi
  done
  if [ -n "$SANITIZER" ] && [ -x "$SANITIZER" ]; then
    say "compute-sanitizer (${SANITIZE_TOOLS:-memcheck racecheck initcheck}) in the background"
    sanitize_chain &
    SAN_PID=$!
  else
    step sanitize skipped 0 "compute-sanitizer not on PATH"
  fi

  t=$(date +%s)
  PT_CAP=${PYTEST_TIMEOUT_S:-120}
  # The image has many pytest plugins (cov, benchmark, ...): load none but xdist, explicitly.
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  XDIST=()
  if "$PY" -c "import xdist.plugin" >/dev/null 2>&1; then XDIST=(-p xdist.plugin -n "${PYTEST_WORKERS:-6}"); fi
  say "pytest -m gpu tests/test_gpu.py ${XDIST[*]} (cap ${PT_CAP}s)"
  timeout -k 10 "$PT_CAP" "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfE \
    "${XDIST[@]}" >"$WORK/pytest_gpu.log" 2>&1
  rc=$?
  if [ ${#XDIST[@]} -gt 0 ] && { [ $rc -eq 3 ] || [ $rc -eq 4 ]; }; then
    # xdist could not start its workers: run serially in the time left.
    say "pytest with xdist failed to start (rc=$rc); running serially"
    mv "$WORK/pytest_gpu.log" "$WORK/pytest_gpu_xdist.log"
    left=$(( PT_CAP - ($(date +%s) - t) ))
    timeout -k 10 "$(clamp "$left" 10 "$PT_CAP")" "$PY" -m pytest -q -m gpu tests/test_gpu.py \
      -p no:cacheprovider -rfE >"$WORK/pytest_gpu.log" 2>&1
    rc=$?
  fi
  summary=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$WORK/pytest_gpu.log" | tail -n 1)
  if [ $rc -eq 0 ]; then status=ok
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT; summary="timed out after ${PT_CAP}s; $summary"
  else status=FAIL; fi
  step gpu_tests "$status" $(( $(date +%s) - t )) "rc=$rc ${summary:-$(tail -n 1 "$WORK/pytest_gpu.log")}"
  tail -n 3 "$WORK/pytest_gpu.log"
  if [ -n "$SAN_PID" ]; then
    say "waiting for compute-sanitizer"
    wait "$SAN_PID"
    cat "$WORK/sanitize_steps.tsv" >>"$STEPS" 2>/dev/null
  fi
else
  step gpu_tests skipped 0 "--cpu: no GPU"
  step sanitize skipped 0 "--cpu: no sanitizer"
fi

# -- 4. benchmarks -----------------------------------------------------------------------------
if [ -n "$FI_PID" ]; then
  say "waiting for the FlashInfer JIT prewarm"
  wait "$FI_PID"
  step flashinfer_jit "$([ -s "$WORK/flashinfer_status.json" ] && echo ok || echo FAIL)" 0 \
    "$(grep '^flashinfer' "$WORK/flashinfer_prewarm.log" | tr '\n' ';')"
fi
t=$(date +%s)
left=$(( DEADLINE_S - $(elapsed) ))
BUDGET=$(clamp $(( left - 45 )) 20 "${BENCH_BUDGET_S:-150}")
BENCH=(benchmarks/bench_decode.py --out-dir "$OUT" --env-json "$WORK/env.json" --time-budget-s "$BUDGET")
if [ "$MODE" = gpu ]; then
  BENCH+=(--flashinfer-status "$WORK/flashinfer_status.json")
else
  BENCH+=(--cpu)
fi
# shellcheck disable=SC2206
BENCH+=(${BENCH_ARGS:-})
say "bench_decode.py, budget ${BUDGET}s"
touch "$WORK/bench.start"
# SIGTERM at the cap: bench_decode.py then writes what it measured; SIGKILL 20 s later.
timeout -k 20 $(( BUDGET + 90 )) "$PY" "${BENCH[@]}" 2>&1 | tee "$WORK/bench.log" | grep -E '^\[|^wrote'
rc=${PIPESTATUS[0]}
json=$(find "$OUT" -maxdepth 1 -name '*_bench.json' -newer "$WORK/bench.start" | head -n 1)
if [ "$rc" -eq 0 ] && [ -n "$json" ]; then
  step benchmark ok $(( $(date +%s) - t )) "$(basename "$json")"
elif [ -n "$json" ]; then  # cut short (an error, or SIGTERM at the cap): what was measured is written
  step benchmark PARTIAL $(( $(date +%s) - t )) "rc=$rc $(grep -m1 -E 'Terminated|Error' "$WORK/bench.log") $(basename "$json")"
else
  step benchmark FAIL $(( $(date +%s) - t )) "rc=$rc $(tail -n 1 "$WORK/bench.log")"
fi

# -- 5. summary (printed last) and logs --------------------------------------------------------
"$PY" benchmarks/summarize.py --steps "$STEPS" --env "$WORK/env.json" ${json:+--bench "$json"} \
  --out "$OUT/summary.md" --total-s "$(elapsed)" >"$WORK/summary.txt" 2>&1 || echo "summarize.py failed" >>"$WORK/summary.txt"
# Keep logs.tar.gz far under the 16 MiB per-file limit: the last 4 MB of any larger log.
find "$WORK" -type f -size +4M -exec sh -c 'tail -c 4000000 "$1" >"$1.tail" && mv "$1.tail" "$1"' _ {} \;
tar -czf "$OUT/logs.tar.gz" -C "$WORK" .
cat "$WORK/summary.txt"
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
# Exit 0 when the run produced its benchmark result (its pass/fail lines are in the summary),
# 1 when the harness itself broke.
[ -n "$json" ]
