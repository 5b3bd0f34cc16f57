#!/usr/bin/env bash
# gpu_check.sh: the GPU proof-and-benchmark run of metrale-attn as ONE command of at most
# 8 minutes (GPU_CHECK_DEADLINE_S, default 465 s) that answers the decisive questions first,
# whatever it is cut short by. Everything lands under $OUT.
#
#   0. wheels: the carried .whl/ installed into /tmp/site; a failure is recorded and the run
#      goes on without FlashInfer
#   1. metrale_attn imports from the checkout
#   2. environment and the device-to-device copy bandwidth             (environment.py)
#      then, in the background: FlashInfer's JIT (CPU, niced; decode specs first, the
#      tensor-core ones only if they can still finish), the static SASS model (CPU, niced;
#      sass_model.py, when present) and compute-sanitizer memcheck / racecheck / initcheck
#      on a small case of every arm (a refusal is recorded, not fatal)    (sanitize_cases.py)
#   3. the GPU tests: pytest -m gpu tests/ (the device runs of the backend-parametrized cases
#      and tests/test_gpu.py); nothing passed is FAIL; the sanitizers are then waited for (bounded)
#   4. the L2 probe: ncu (--clock-control none) on one small configuration per arm and
#      kernel implementation; absence or refusal recorded                  (l2_probe.py)
#   5. the sweep, with what the deadline leaves: the decisive configurations first (bf16,
#      fp8, heads_per_cta), then the grid; FlexAttention and FlashInfer last (sweep.py);
#      every arm on simt and mma; step mma_selftest: whether the mma rows ran mma (a device
#      that fails the self-test gets simt: FALLBACK, the mma rows not timed)
#   6. the decode loop: examples/decode_loop.py, the serving path the vLLM backend shares, on
#      the device eagerly, compiled and under a CUDA graph (every output against float64), and a
#      step at batch 64 x 4k timed against the same loop on PyTorch SDPA; its time is reserved
#      out of the sweep's budget, so the grid gives way, not this (decode_loop_check.py)
#   6b. the split-K merge launched as the attention grid's programmatic dependent and plainly,
#      side by side on the calls its launch gap touches: bytes equal, times      (pdl_check.py)
#   7. summary: summary.md, and a short table printed LAST                     (summary.py)
#
# After every step (and every CHECKPOINT_S seconds during the sweep) summary.md is rewritten
# and logs.tar.gz repacked in $OUT, and the sweep rewrites its JSON and markdown, so a run cut
# off from outside still brings back its logs and what it measured. Progress lines are short
# and printed as they come; the short table is printed last.
#
#   bash benchmarks/gpu_check.sh           the full run (device run: timeout_s 560, carry .whl)
#   bash benchmarks/gpu_check.sh --quick   the short rerun, <= 4 minutes (deadline 220 s): environment,
#                                          L2 probe, decisive tiers; no tests, sanitizers or baselines
#   bash benchmarks/gpu_check.sh --cpu     the dry run on the CPU backend simulator (CI runs it; with
#                                          --quick too: the rerun's steps)
#
# Exit 0 when the sweep timed rows of ours (pass/fail lines are in the summary), 1 when not.
#
# Environment knobs: OUT (./gpu_check_out), PYTHON (python3), GPU_CHECK_DEADLINE_S (465; 220
# --quick), WHEELS_DIR (.whl; given explicitly, installed in --cpu too), WHEEL_TARGET (/tmp/site),
# PYTEST_TIMEOUT_S (110), PYTEST_WORKERS (6, with pytest-xdist), GPU_TEST_PATHS (tests/; --cpu: tests/test_gpu.py), DECODE_LOOP_CAP_S (120; 60 --cpu;
# 0: skip the step), PDL_CHECK_CAP_S (45; 0: skip the step), SANITIZE_TOOLS ("memcheck
# racecheck initcheck"), SANITIZE_TIMEOUT_S (45 each), FLASHINFER_JIT_CAP_S (300), L2_PROBE (1),
# L2_PROBE_CAP_S (70), NCU (ncu to use; "none"), SASS_MODEL_JSON (predictions to use), SASS_REPORT
# (1: run sass_model.py in --cpu too), SASS_REPORT_CAP_S (150), BENCH_BUDGET_S (300 at most),
# BENCH_ARGS (extra sweep.py flags), CHECKPOINT_S (30), KEEP_WORK=1 (keep the log folder).
set -uo pipefail

MODE=gpu
PROFILE=full
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --quick) PROFILE=quick ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --cpu, --quick or nothing)" >&2; exit 2 ;;
  esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
PY=${PYTHON:-python3}
if [ "$PROFILE" = quick ]; then DEADLINE_S=${GPU_CHECK_DEADLINE_S:-220}; else DEADLINE_S=${GPU_CHECK_DEADLINE_S:-465}; fi
CHECKPOINT_S=${CHECKPOINT_S:-30}
T0=$(date +%s)
STEPS=$WORK/steps.tsv
export PYTHONUNBUFFERED=1
# nvcc, ncu and compute-sanitizer; and the scripts of carried wheels (ninja, for FlashInfer's JIT).
[ -d /usr/local/cuda/bin ] && case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) export PATH="$PATH:/usr/local/cuda/bin" ;; esac
: >"$STEPS"

elapsed() { echo $(( $(date +%s) - T0 )); }
since() { echo $(( $(date +%s) - $1 )); }
# step NAME STATUS SECONDS DETAIL: one line of the step table (tab-separated, detail cut short).
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(echo "$4" | tr '\t\n' '  ' | cut -c1-300)" >>"$STEPS"; }
say() { echo "[gpu_check $(elapsed)s] $*"; }
clamp() { local v=$1 lo=$2 hi=$3; [ "$v" -lt "$lo" ] && v=$lo; [ "$v" -gt "$hi" ] && v=$hi; echo "$v"; }
verdict() { "$PY" -m benchmarks.steps "$@" 2>/dev/null || printf 'FAIL\tsteps.py failed\n'; }
latest_json() {
  [ -e "$WORK/bench.start" ] && find "$OUT" -maxdepth 1 -name '*_bench.json' -newer "$WORK/bench.start" | head -n 1
}
# logs.tar.gz under the 16 MiB per-file limit: files over 4 MB travel as their last 4 MB.
pack_logs() {
  local f excludes=()
  rm -rf "$WORK/.tails" && mkdir -p "$WORK/.tails"
  while IFS= read -r f; do
    excludes+=(--exclude="./${f#"$WORK"/}")
    tail -c 4000000 "$f" >"$WORK/.tails/$(basename "$f").tail"
  done < <(find "$WORK" -type f -size +4M -not -path "$WORK/.tails/*")
  tar -czf "$OUT/.logs.tar.gz.tmp" -C "$WORK" "${excludes[@]}" . 2>/dev/null
  [ -s "$OUT/.logs.tar.gz.tmp" ] && mv -f "$OUT/.logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}
# checkpoint [RUNNING_STEP]: summary.md rewritten from what is known now, logs repacked.
checkpoint() {
  local json; json=$(latest_json)
  "$PY" -m benchmarks.summary --steps "$STEPS" --env "$WORK/env.json" ${json:+--bench "$json"} \
    --probe "$WORK/l2_probe.json" --mode "$MODE" --out "$OUT/summary.md" --total-s "$(elapsed)" \
    ${1:+--running "$1"} --quiet >>"$WORK/checkpoint.log" 2>&1
  pack_logs
}

say "mode=$MODE profile=$PROFILE out=$OUT logs=$WORK deadline=${DEADLINE_S}s"
# --cpu runs the same steps on the CPU backend; sweep.py --cpu then sweeps its own tiny cpu profile.
CPUFLAG=(); [ "$MODE" = cpu ] && CPUFLAG=(--cpu)

# -- 0. wheels ---------------------------------------------------------------------------------
NO_FLASHINFER=''
t=$(date +%s)
WHEELS=${WHEELS_DIR:-$REPO/.whl}
SITE=${WHEEL_TARGET:-/tmp/site}
if [ "$PROFILE" = quick ] || { [ "$MODE" = cpu ] && [ -z "${WHEELS_DIR:-}" ]; }; then
  step wheels skipped 0 "$([ "$PROFILE" = quick ] && echo "--quick: no baselines" || echo "--cpu: no baselines")"
  NO_FLASHINFER="profile $PROFILE"
elif ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  step wheels skipped 0 "no wheels in $WHEELS: FlashInfer unavailable"
  NO_FLASHINFER="no wheels carried ($WHEELS)"
elif timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$WORK/wheels.log" 2>&1; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  [ -d "$SITE/bin" ] && export PATH="$PATH:$SITE/bin"
  step wheels ok "$(since "$t")" "$(cd "$WHEELS" && ls ./*.whl | sed 's|^\./||' | cut -d- -f1,2 | tr '\n' ' ')into $SITE"
else
  NO_FLASHINFER="wheel install failed: $(grep -v '^$' "$WORK/wheels.log" | tail -n 1)"
  step wheels FAIL "$(since "$t")" "going on without FlashInfer: $NO_FLASHINFER"
fi
checkpoint

# -- 1. the package must import with its kernel sources ---------------------------------------
# Run from the checkout without installing: metrale_attn finds kernels_cu/ beside itself.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
t=$(date +%s)
if "$PY" -c "import metrale_attn.kernels as k; k.read_source(k.COMMON_HEADER)" >"$WORK/install.log" 2>&1; then
  step import ok "$(since "$t")" "metrale_attn imports from the checkout"
else
  step import FAIL "$(since "$t")" "metrale_attn does not import: $(tail -n 1 "$WORK/install.log")"
fi

# -- 2. environment and copy bandwidth --------------------------------------------------------
t=$(date +%s)
if [ "$MODE" = gpu ]; then
  timeout 20 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
  timeout 20 nvidia-smi -q >"$WORK/nvidia-smi-q.txt" 2>&1
fi
timeout 60 "$PY" -m benchmarks.environment --out "$WORK/env.json" "${CPUFLAG[@]}" >"$WORK/env.log" 2>&1
rc=$?
cat "$WORK/env.log"
if [ $rc -eq 0 ]; then
  step environment ok "$(since "$t")" "$(grep -o '^copy bandwidth: [0-9.]* TB/s' "$WORK/env.log"); $(head -n 1 "$WORK/env.log" | cut -c1-70)"
else
  step environment FAIL "$(since "$t")" "rc=$rc: $(tail -n 1 "$WORK/env.log")"
fi
checkpoint

# -- background work beside the tests: FlashInfer's JIT, the SASS model, the sanitizers ---------
FI_PID=''
FI_STATUS=$WORK/flashinfer_status.json
if [ "$PROFILE" = full ] && [ "$MODE" = gpu ]; then
  if [ -n "$NO_FLASHINFER" ]; then
    printf '{"specs": {}, "import_error": "%s"}\n' "$(echo "$NO_FLASHINFER" | tr -d '"\\' | cut -c1-300)" >"$FI_STATUS"
  else
    mkdir -p "$WORK/flashinfer"
    # Niced: its nvcc jobs would otherwise starve the pytest workers; it gets the CPU they leave.
    NICE=(); command -v nice >/dev/null 2>&1 && NICE=(nice -n 10)
    FI_CAP=${FLASHINFER_JIT_CAP_S:-300}
    timeout $((FI_CAP + 30)) "${NICE[@]}" "$PY" -m benchmarks.baselines flashinfer-prewarm --timeout-s "$FI_CAP" \
      --out "$FI_STATUS" --log-dir "$WORK/flashinfer" </dev/null >"$WORK/flashinfer_prewarm.log" 2>&1 &
    FI_PID=$!
  fi
fi

SASS_PID=''
SASS_JSON=${SASS_MODEL_JSON:-}
if [ -z "$SASS_JSON" ] && [ -f benchmarks/sass_model.py ] && { [ "$MODE" = gpu ] || [ "${SASS_REPORT:-0}" = 1 ]; }; then
  timeout "${SASS_REPORT_CAP_S:-150}" nice -n 10 "$PY" -m benchmarks.sass_model --levers none --json "$WORK/sass_model.json" \
    </dev/null >"$WORK/sass_report.md" 2>"$WORK/sass_report.err" &
  SASS_PID=$!
fi

sanitize_chain() {  # runs in the background; each tool capped, all done by SAN_DEADLINE
  local tool t rc left out
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    t=$(date +%s)
    left=$(( SAN_DEADLINE - t ))
    if [ "$left" -lt 10 ]; then
      STEPS="$WORK/sanitize_steps.tsv" step "sanitize_$tool" skipped 0 "no time left before the sweep"
      continue
    fi
    timeout -k 10 "$(clamp "$left" 10 "${SANITIZE_TIMEOUT_S:-45}")" "$SANITIZER" --tool "$tool" --error-exitcode 3 \
      --print-limit 20 "$PY" -m benchmarks.sanitize_cases </dev/null >"$WORK/sanitize_$tool.log" 2>&1
    rc=$?
    out=$(verdict sanitizer --rc "$rc" --log "$WORK/sanitize_$tool.log")
    STEPS="$WORK/sanitize_steps.tsv" step "sanitize_$tool" "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
  done
}

# -- 3. the GPU tests (the sanitizers beside them) ------------------------------------------------
PT_CAP=${PYTEST_TIMEOUT_S:-110}
SAN_PID=''
if [ "$PROFILE" != quick ]; then
  SANITIZER=$(command -v compute-sanitizer)
  for candidate in /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
    if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then SANITIZER=$candidate; fi
  done
  if [ "$MODE" = cpu ]; then
    step sanitize skipped 0 "--cpu: no sanitizer (benchmarks/tests/test_benchmarks.py runs sanitize_cases.py --cpu)"
  elif [ -n "$SANITIZER" ] && [ -x "$SANITIZER" ]; then
    say "compute-sanitizer (${SANITIZE_TOOLS:-memcheck racecheck initcheck}) beside the tests"
    SAN_DEADLINE=$(( $(date +%s) + PT_CAP + 15 ))
    sanitize_chain &
    SAN_PID=$!
  else
    step sanitize skipped 0 "compute-sanitizer not on PATH"
  fi

  t=$(date +%s)
  # The image has many pytest plugins (cov, benchmark, ...): load none but xdist, explicitly.
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  XDIST=()
  if [ "$MODE" = gpu ] && "$PY" -c "import xdist.plugin" >/dev/null 2>&1; then
    XDIST=(-p xdist.plugin -n "${PYTEST_WORKERS:-6}")
  fi
  # Every test file is collected (a module that fails to import costs its own tests, not the run's);
  # the CPU dry run collects one (every GPU test skips there, and all of tests/ is ~10 s of CI's run).
  if [ "$MODE" = gpu ]; then GPU_TEST_PATHS=${GPU_TEST_PATHS:-tests/}; else GPU_TEST_PATHS=${GPU_TEST_PATHS:-tests/test_gpu.py}; fi
  say "pytest -m gpu $GPU_TEST_PATHS ${XDIST[*]} (cap ${PT_CAP}s)"
  # shellcheck disable=SC2086  # GPU_TEST_PATHS: paths, split on spaces
  timeout -k 10 "$PT_CAP" "$PY" -m pytest -q -m gpu $GPU_TEST_PATHS -p no:cacheprovider -rfE --continue-on-collection-errors \
    "${XDIST[@]}" >"$WORK/pytest_gpu.log" 2>&1
  rc=$?
  if [ ${#XDIST[@]} -gt 0 ] && { [ $rc -eq 3 ] || [ $rc -eq 4 ]; }; then
    # xdist could not start its workers: run serially in the time left.
    say "pytest with xdist failed to start (rc=$rc); running serially"
    mv "$WORK/pytest_gpu.log" "$WORK/pytest_gpu_xdist.log"
    # shellcheck disable=SC2086
    timeout -k 10 "$(clamp $(( PT_CAP - $(since "$t") )) 10 "$PT_CAP")" "$PY" -m pytest -q -m gpu $GPU_TEST_PATHS \
      -p no:cacheprovider -rfE --continue-on-collection-errors >"$WORK/pytest_gpu.log" 2>&1
    rc=$?
  fi
  out=$(verdict pytest --rc "$rc" --log "$WORK/pytest_gpu.log" --mode "$MODE")
  step gpu_tests "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
  say "gpu_tests: ${out%%$'\t'*} ${out#*$'\t'}"
  if [ -n "$SAN_PID" ]; then
    say "waiting for compute-sanitizer (until $(( SAN_DEADLINE - T0 + 10 ))s at most)"
    wait "$SAN_PID"
    cat "$WORK/sanitize_steps.tsv" >>"$STEPS" 2>/dev/null
  fi
else
  step gpu_tests skipped 0 "--quick: no tests, no sanitizers (the sweep still checks every output it times)"
fi
checkpoint

# -- 4. the L2 probe ----------------------------------------------------------------------------
if [ "${L2_PROBE:-1}" = 1 ]; then
  t=$(date +%s)
  L2_CAP=${L2_PROBE_CAP_S:-70}
  say "l2_probe.py (ncu, cap ${L2_CAP}s)"
  timeout -k 10 $((L2_CAP + 15)) "$PY" -m benchmarks.l2_probe probe --out "$WORK/l2_probe.json" --work "$WORK/l2_probe" \
    --timeout-s "$L2_CAP" "${CPUFLAG[@]}" ${NCU:+--ncu "$NCU"} 2>"$WORK/l2_probe.err" | tee "$WORK/l2_probe.log"
  out=$(verdict json-status "$WORK/l2_probe.json")
  step l2_probe "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
else
  step l2_probe skipped 0 "L2_PROBE=0"
fi
checkpoint

# -- the SASS model's predictions: fresh if its report finished, else the committed one -----------
t=$(date +%s)
if [ -n "$SASS_JSON" ]; then
  step sass_model ok 0 "given: $SASS_JSON"
else
  if [ -n "$SASS_PID" ]; then
    if kill -0 "$SASS_PID" 2>/dev/null; then kill "$SASS_PID" 2>/dev/null; fi  # the GPU does not wait for it
    wait "$SASS_PID" 2>/dev/null
  fi
  if [ -s "$WORK/sass_model.json" ]; then
    SASS_JSON=$WORK/sass_model.json
    step sass_model ok 0 "fresh: sass_model.py on this checkout"
  elif [ -s benchmarks/results/sass_model.json ]; then
    SASS_JSON=$REPO/benchmarks/results/sass_model.json
    step sass_model ok 0 "committed benchmarks/results/sass_model.json$([ -n "$SASS_PID" ] && echo ' (the fresh report did not finish)')"
  else
    step sass_model none 0 "no SASS report: no prediction beside the rows"
  fi
fi

# -- 5. the sweep ---------------------------------------------------------------------------------
t=$(date +%s)
# The decode loop's and the PDL check's time come out of the sweep's budget (the grid, its last tier, gives way).
if [ "$PROFILE" = quick ]; then LOOP_CAP=0; elif [ "$MODE" = cpu ]; then LOOP_CAP=${DECODE_LOOP_CAP_S:-60}; else
  LOOP_CAP=${DECODE_LOOP_CAP_S:-120}; fi
if [ "$PROFILE" = quick ]; then PDL_CAP=0; else PDL_CAP=${PDL_CHECK_CAP_S:-45}; fi
BUDGET=$(clamp $(( DEADLINE_S - $(elapsed) - 30 - LOOP_CAP - PDL_CAP )) 30 "${BENCH_BUDGET_S:-300}")
BENCH=(-m benchmarks.sweep --out-dir "$OUT" --env-json "$WORK/env.json" --time-budget-s "$BUDGET"
       --profile "$PROFILE" --probe-json "$WORK/l2_probe.json" --checkpoint-s "$CHECKPOINT_S")
[ -n "$SASS_JSON" ] && BENCH+=(--sass-json "$SASS_JSON")
if [ "$MODE" = cpu ]; then BENCH+=(--cpu); elif [ "$PROFILE" = full ]; then BENCH+=(--flashinfer-status "$FI_STATUS"); fi
# shellcheck disable=SC2206
BENCH+=(${BENCH_ARGS:-})
say "sweep.py --profile $PROFILE${CPUFLAG[*]:+ --cpu}, budget ${BUDGET}s"
touch "$WORK/bench.start"
checkpoint_loop() {  # summary.md and logs every CHECKPOINT_S while the sweep runs
  local n=0
  while [ ! -e "$WORK/bench.done" ]; do
    sleep 1; n=$((n + 1))
    if [ "$n" -ge "$CHECKPOINT_S" ]; then n=0; checkpoint benchmark; fi
  done
}
checkpoint_loop &
CK_PID=$!
# SIGTERM at the cap: sweep.py then writes what it measured; SIGKILL 15 s later.
timeout -k 15 $((BUDGET + 25)) "$PY" "${BENCH[@]}" 2>"$WORK/bench.err" | tee "$WORK/bench.log" \
  | grep --line-buffered -E '^\[|^wrote '
rc=${PIPESTATUS[0]}
touch "$WORK/bench.done"
wait "$CK_PID"
json=$(latest_json)
out=$(verdict bench --rc "$rc" ${json:+--json "$json"})
step benchmark "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
out=$(verdict selftest ${json:+--json "$json"})  # whether the mma rows ran mma (read from what was built)
step mma_selftest "${out%%$'\t'*}" 0 "${out#*$'\t'}"

if [ -n "$FI_PID" ]; then
  kill -0 "$FI_PID" 2>/dev/null && kill "$FI_PID" 2>/dev/null  # its cleanup kills the nvcc groups
  wait "$FI_PID" 2>/dev/null
  out=$(verdict flashinfer "$FI_STATUS")
  step flashinfer_jit "${out%%$'\t'*}" 0 "${out#*$'\t'}"
elif [ "$PROFILE" = full ] && [ "$MODE" = gpu ]; then
  step flashinfer_jit skipped 0 "$NO_FLASHINFER"
fi

# -- 6. the decode loop: the serving path the vLLM backend shares, end to end on the device ---------
if [ "$LOOP_CAP" -gt 0 ]; then
  t=$(date +%s)
  say "decode_loop_check.py (cap ${LOOP_CAP}s)"
  timeout -k 10 $((LOOP_CAP + 15)) "$PY" -m benchmarks.decode_loop_check "${CPUFLAG[@]}" --cap-s "$LOOP_CAP" \
    --out "$WORK/decode_loop.json" 2>"$WORK/decode_loop.err" | tee "$WORK/decode_loop.log" | grep --line-buffered '^\['
  out=$(tail -n 1 "$WORK/decode_loop.log")
  case "$out" in ok$'\t'*|FAIL$'\t'*|PARTIAL$'\t'*) ;; *) out="FAIL"$'\t'"no verdict: $(tail -n 1 "$WORK/decode_loop.err")" ;; esac
  step decode_loop "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
else
  step decode_loop skipped 0 "--quick: no decode loop"
fi
checkpoint

# -- 6b. the split-K merge with and without programmatic dependent launch, side by side -------------
if [ "$PDL_CAP" -gt 0 ]; then
  t=$(date +%s)
  say "pdl_check.py (cap ${PDL_CAP}s)"
  timeout -k 10 "$PDL_CAP" "$PY" -m benchmarks.pdl_check "${CPUFLAG[@]}" --out "$OUT/pdl_check.json" \
    >"$WORK/pdl_check.log" 2>&1
  rc=$?
  case $rc in
    0) step pdl_check ok "$(since "$t")" "$(grep -c bytes_equal "$WORK/pdl_check.log") calls, bytes equal both ways; times in pdl_check.json" ;;
    124|137) step pdl_check FAIL "$(since "$t")" "past its cap of ${PDL_CAP}s" ;;
    *) step pdl_check FAIL "$(since "$t")" "rc=$rc: $(tail -n 1 "$WORK/pdl_check.log")" ;;
  esac
else
  step pdl_check skipped 0 "--quick: no PDL check"
fi
checkpoint

# -- 7. summary (printed last) and logs --------------------------------------------------------
"$PY" -m benchmarks.summary --steps "$STEPS" --env "$WORK/env.json" ${json:+--bench "$json"} \
  --probe "$WORK/l2_probe.json" --mode "$MODE" --out "$OUT/summary.md" --total-s "$(elapsed)" \
  >"$WORK/summary.txt" 2>&1 || echo "summary.py failed" >>"$WORK/summary.txt"
pack_logs
cat "$WORK/summary.txt"
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
# Exit 0 when the sweep timed rows of ours (its pass/fail lines are in the summary), 1 when not.
"$PY" -m benchmarks.steps exit-code ${json:+--json "$json"} >/dev/null
