#!/usr/bin/env bash
# gpu_check.sh: the GPU proof-and-benchmark run of metrale-attn as ONE command that measures by
# value, the decisive cells first, whatever it is cut short by. Its steps, their order and their
# caps are benchmarks/schedule.py's (read at the start; a test checks the order); everything
# lands under $OUT.
#
#   0. wheels: the carried .whl/ installed into /tmp/site (a failure: on without FlashInfer)
#   1. metrale_attn imports from the checkout
#      beside the next steps: FlashInfer's JIT (CPU, niced) and the decisive kernels compiled by
#      NVRTC in parallel processes (metrale-attn check --compile-only)
#   2. environment and the device-to-device copy bandwidth                 (environment.py)
#   3. decisive: metrale-attn check's own code on the decisive cells (schedule.DECISIVE: 32/8/128,
#      64/8/128, 24/4/256 x bf16, fp8 x batch 64 and 16 at 4k, batch 1 at 32k), the default
#      kernel, the simt reference and PyTorch SDPA, each in a process of its own (a CUDA fault
#      costs one implementation, named), each output checked against float64 before it is timed;
#      then the wide layers' named cells (schedule.DECISIVE_CELLS, --cells: Gemma 4's 16/2/512 and
#      MLA's 16 and 128 heads at 576/512, bf16 64 x 4k) on the default kernel (simt underneath) and
#      SDPA; $OUT/decisive/ (report.md, report.json, report.png, the events as they came)
#   4. the GPU tests: pytest -m 'gpu and not slow', a per-test timeout, failures listed
#   5. compute-sanitizer memcheck on 12 small cases (3 arms x 2 cases x mma, simt)
#   6. FlashInfer on the decisive cells (what its JIT built), into the same report
#   7. the sweep, with what the deadline leaves: heads per CTA, the features, every forced arm
#      on simt and mma, the grid; FlexAttention and FlashInfer last                  (sweep.py)
#   8. the decode loop (the vLLM backend's serving path on the device), then the split-K merge
#      as a programmatic dependent and plainly                      (decode_loop_check.py, pdl_check.py)
#   9. summary: summary.md, and a short table printed LAST                        (summary.py)
# --quick (the rerun): environment, the decisive cells again (the default kernel), racecheck and
# initcheck, the model probes (model_probes.py: one CTA's tile and fixed cost, the fp8 conversion's
# rate; $OUT/model_probes.json), the L2 probe (ncu), the sweep's heads-per-CTA and forced-arm tiers.
#
# After every step (and every CHECKPOINT_S seconds during the sweep) summary.md is rewritten
# and logs.tar.gz repacked in $OUT, and the check and the sweep write what they measured as
# they go, so a run cut off from outside still brings back its logs and its numbers.
#
#   bash benchmarks/gpu_check.sh           the full run (device call: kind nvidia-h200, timeout_s 480, carry .whl)
#   bash benchmarks/gpu_check.sh --quick   the rerun (timeout_s 240)
#   bash benchmarks/gpu_check.sh --cpu     the dry run on the CPU backend (CI runs it; with --quick too)
#
# Exit 0 when the run measured cells of ours (the decisive check's, or the sweep's rows), 1 when not.
#
# Environment knobs: OUT (./gpu_check_out), PYTHON (python3), GPU_CHECK_DEADLINE_S (schedule.py's: 420; 200
# --quick), WHEELS_DIR (.whl; given explicitly, installed in --cpu too), WHEEL_TARGET (/tmp/site),
# PYTEST_TIMEOUT_S (the step's cap), PYTEST_TEST_TIMEOUT_S (60, each test, with pytest-timeout), PYTEST_WORKERS
# (6, with pytest-xdist), GPU_TEST_PATHS (tests/; --cpu: tests/test_gpu.py), DECODE_LOOP_CAP_S (schedule's;
# 0: skip), PDL_CHECK_CAP_S (schedule's; 0: skip), SANITIZE_IMPLS (mma,simt), FLASHINFER_JIT_CAP_S (300),
# L2_PROBE (1), NCU (ncu to use; "none"), SASS_MODEL_JSON (predictions to use; default the committed
# benchmarks/model/results/sass_model.json), BENCH_BUDGET_S (300 at most), BENCH_ARGS (extra sweep.py flags),
# CHECKPOINT_S (30), KEEP_WORK=1 (keep the log folder).
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
T0=$(date +%s)
STEPS=$WORK/steps.tsv
DECISIVE_OUT=$OUT/decisive
export PYTHONUNBUFFERED=1
# Run from the checkout without installing: metrale_attn finds kernels_cu/ beside itself.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# nvcc, ncu and compute-sanitizer; and the scripts of carried wheels (ninja, for FlashInfer's JIT).
[ -d /usr/local/cuda/bin ] && case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) export PATH="$PATH:/usr/local/cuda/bin" ;; esac
: >"$STEPS"
# The schedule: CAP_<STEP>, DEADLINE_S_DEFAULT, DECISIVE_* (benchmarks/schedule.py, the one source).
SCHEDULE=$("$PY" -m benchmarks.schedule shell --profile "$PROFILE") || { echo "gpu_check.sh: benchmarks/schedule.py failed" >&2; exit 2; }
eval "$SCHEDULE"
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-$DEADLINE_S_DEFAULT}
CHECKPOINT_S=${CHECKPOINT_S:-30}

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
SASS_JSON=${SASS_MODEL_JSON:-$REPO/benchmarks/model/results/sass_model.json}
# checkpoint [RUNNING_STEP]: summary.md rewritten from what is known now, logs repacked.
checkpoint() {
  local json; json=$(latest_json)
  "$PY" -m benchmarks.summary --steps "$STEPS" --env "$WORK/env.json" ${json:+--bench "$json"} \
    --check "$DECISIVE_OUT/report.json" --sass-json "$SASS_JSON" --probe "$WORK/l2_probe.json" --mode "$MODE" \
    --out "$OUT/summary.md" --total-s "$(elapsed)" ${1:+--running "$1"} --quiet >>"$WORK/checkpoint.log" 2>&1
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
elif timeout "$CAP_WHEELS" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$WORK/wheels.log" 2>&1; then
  export PYTHONPATH="$PYTHONPATH:$SITE"
  [ -d "$SITE/bin" ] && export PATH="$PATH:$SITE/bin"
  step wheels ok "$(since "$t")" "$(cd "$WHEELS" && ls ./*.whl | sed 's|^\./||' | cut -d- -f1,2 | tr '\n' ' ')into $SITE"
else
  NO_FLASHINFER="wheel install failed: $(grep -v '^$' "$WORK/wheels.log" | tail -n 1)"
  step wheels FAIL "$(since "$t")" "going on without FlashInfer: $NO_FLASHINFER"
fi

# -- 1. the package must import with its kernel sources ---------------------------------------
t=$(date +%s)
if timeout "$CAP_IMPORT" "$PY" -c "import metrale_attn.sources as s; s.read_source(s.COMMON_HEADER)" >"$WORK/install.log" 2>&1; then
  step import ok "$(since "$t")" "metrale_attn imports from the checkout"
else
  step import FAIL "$(since "$t")" "metrale_attn does not import: $(tail -n 1 "$WORK/install.log")"
fi

# The decisive cells as metrale-attn check takes them (the CPU dry run: the smallest shape, correctness only).
CHECK=(-m metrale_attn check --out "$DECISIVE_OUT" --kv-dtype "$DECISIVE_KV" --impl "$DECISIVE_IMPLS")
if [ "$MODE" = cpu ]; then CHECK+=(--backend cpu --model 4/1/64 --cells "$DECISIVE_CELLS_CPU")
else CHECK+=(--model "$DECISIVE_MODELS" --points "$DECISIVE_POINTS" --cells "$DECISIVE_CELLS"); fi
[ "$PROFILE" = quick ] && CHECK+=(--no-correctness)

# -- beside the next steps: FlashInfer's JIT, the decisive kernels' compiles ---------------------
FI_PID=''
FI_STATUS=$WORK/flashinfer_status.json
if [ "$PROFILE" = full ] && [ "$MODE" = gpu ]; then
  if [ -n "$NO_FLASHINFER" ]; then
    printf '{"specs": {}, "import_error": "%s"}\n' "$(echo "$NO_FLASHINFER" | tr -d '"\\' | cut -c1-300)" >"$FI_STATUS"
  else
    mkdir -p "$WORK/flashinfer"
    # Niced: its nvcc jobs would otherwise starve the tests and the compiles; it gets the CPU they leave.
    NICE=(); command -v nice >/dev/null 2>&1 && NICE=(nice -n 10)
    FI_CAP=${FLASHINFER_JIT_CAP_S:-$CAP_FLASHINFER_JIT}
    timeout $((FI_CAP + 30)) "${NICE[@]}" "$PY" -m benchmarks.baselines flashinfer-prewarm --timeout-s "$FI_CAP" \
      --out "$FI_STATUS" --log-dir "$WORK/flashinfer" </dev/null >"$WORK/flashinfer_prewarm.log" 2>&1 &
    FI_PID=$!
  fi
fi
COMPILE_PID=''
COMPILE_T=$(date +%s)
if [ "$MODE" = gpu ]; then
  timeout -k 5 "$CAP_COMPILE" "$PY" "${CHECK[@]}" --compile-only </dev/null >"$WORK/compile.log" 2>&1 &
  COMPILE_PID=$!
fi
checkpoint

# -- 2. environment and copy bandwidth --------------------------------------------------------
t=$(date +%s)
if [ "$MODE" = gpu ]; then
  timeout 20 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
  timeout 20 nvidia-smi -q >"$WORK/nvidia-smi-q.txt" 2>&1
fi
timeout "$CAP_ENVIRONMENT" "$PY" -m benchmarks.environment --out "$WORK/env.json" "${CPUFLAG[@]}" >"$WORK/env.log" 2>&1
rc=$?
cat "$WORK/env.log"
if [ $rc -eq 0 ]; then
  step environment ok "$(since "$t")" "$(grep -o '^copy bandwidth: [0-9.]* TB/s' "$WORK/env.log"); $(head -n 1 "$WORK/env.log" | cut -c1-70)"
else
  step environment FAIL "$(since "$t")" "rc=$rc: $(tail -n 1 "$WORK/env.log")"
fi
if [ -n "$COMPILE_PID" ]; then
  wait "$COMPILE_PID"
  rc=$?
  step compile "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$(since "$COMPILE_T")" "rc=$rc $(grep -E '^compiled|failed' "$WORK/compile.log" | tail -n 1)"
else
  step compile skipped 0 "--cpu: the CPU backend builds its modules as the check runs"
fi
checkpoint

# -- 3. the decisive cells: metrale-attn check ---------------------------------------------------
t=$(date +%s)
say "decisive: metrale-attn check ${CHECK[*]:3} (deadline ${CAP_DECISIVE}s)"
timeout -k 10 $((CAP_DECISIVE + 30)) "$PY" "${CHECK[@]}" --deadline-s "$CAP_DECISIVE" </dev/null 2>"$WORK/decisive.err" \
  | tee "$WORK/decisive.log" | grep --line-buffered -E '^\[check|^VERDICT'
rc=${PIPESTATUS[0]}
out=$(verdict check --rc "$rc" --report "$DECISIVE_OUT/report.json")
step decisive "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
say "decisive: ${out%%$'\t'*} ${out#*$'\t'}"
checkpoint

# -- 4. the GPU tests ------------------------------------------------------------------------------
if [ "$PROFILE" = full ]; then
  t=$(date +%s)
  PT_CAP=${PYTEST_TIMEOUT_S:-$CAP_GPU_TESTS}
  # The image has many pytest plugins (cov, benchmark, ...): load none but xdist and timeout, explicitly.
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  PLUGINS=()
  if [ "$MODE" = gpu ] && "$PY" -c "import xdist.plugin" >/dev/null 2>&1; then
    PLUGINS+=(-p xdist.plugin -n "${PYTEST_WORKERS:-6}")
  fi
  if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    PLUGINS+=(-p pytest_timeout --timeout "${PYTEST_TEST_TIMEOUT_S:-60}")
  fi
  # Every test file is collected (a module that fails to import costs its own tests, not the run's);
  # the CPU dry run collects one (every GPU test skips there, and all of tests/ is ~10 s of CI's run).
  if [ "$MODE" = gpu ]; then GPU_TEST_PATHS=${GPU_TEST_PATHS:-tests/}; else GPU_TEST_PATHS=${GPU_TEST_PATHS:-tests/test_gpu.py}; fi
  say "pytest -m 'gpu and not slow' $GPU_TEST_PATHS ${PLUGINS[*]} (cap ${PT_CAP}s)"
  # shellcheck disable=SC2086  # GPU_TEST_PATHS: paths, split on spaces
  timeout -k 10 "$PT_CAP" "$PY" -m pytest -q -m 'gpu and not slow' $GPU_TEST_PATHS -p no:cacheprovider -rfE \
    --continue-on-collection-errors "${PLUGINS[@]}" >"$WORK/pytest_gpu.log" 2>&1
  rc=$?
  out=$(verdict pytest --rc "$rc" --log "$WORK/pytest_gpu.log" --mode "$MODE")
  step gpu_tests "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
  say "gpu_tests: ${out%%$'\t'*} ${out#*$'\t'}"
  grep -E '^(FAILED|ERROR) ' "$WORK/pytest_gpu.log" | head -n 20
else
  step gpu_tests skipped 0 "--quick: no tests (the decisive cells still check every output they time)"
fi
checkpoint

# -- 5. compute-sanitizer: memcheck (full); racecheck and initcheck (the rerun) ----------------------
SANITIZER=$(command -v compute-sanitizer)
for candidate in /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
  if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then SANITIZER=$candidate; fi
done
if [ "$PROFILE" = full ]; then TOOLS="memcheck"; else TOOLS="racecheck initcheck"; fi
for tool in $TOOLS; do
  cap_var="CAP_SANITIZE_$(echo "$tool" | tr '[:lower:]' '[:upper:]')"
  if [ "$MODE" = cpu ]; then
    step "sanitize_$tool" skipped 0 "--cpu: no sanitizer (benchmarks/tests/test_benchmarks.py runs sanitize_cases.py --cpu)"
  elif [ -z "$SANITIZER" ] || [ ! -x "$SANITIZER" ]; then
    step "sanitize_$tool" skipped 0 "compute-sanitizer not on PATH"
  else
    t=$(date +%s)
    say "compute-sanitizer --tool $tool (cap ${!cap_var}s)"
    timeout -k 10 "${!cap_var}" "$SANITIZER" --tool "$tool" --error-exitcode 3 --print-limit 20 "$PY" -m benchmarks.sanitize_cases \
      --impls "${SANITIZE_IMPLS:-mma,simt}" </dev/null >"$WORK/sanitize_$tool.log" 2>&1
    rc=$?
    out=$(verdict sanitizer --rc "$rc" --log "$WORK/sanitize_$tool.log" --tool "$tool")
    step "sanitize_$tool" "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
  fi
done
checkpoint

# -- 6. FlashInfer on the decisive cells (full) ------------------------------------------------------
if [ "$PROFILE" = full ] && [ "$MODE" = gpu ]; then
  t=$(date +%s)
  if [ -n "$FI_PID" ]; then
    # Its JIT has had the whole run so far; what it has not built by now is not timed.
    kill -0 "$FI_PID" 2>/dev/null && kill "$FI_PID" 2>/dev/null  # its cleanup kills the nvcc groups
    wait "$FI_PID" 2>/dev/null
    out=$(verdict flashinfer "$FI_STATUS")
    step flashinfer_jit "${out%%$'\t'*}" 0 "${out#*$'\t'}"
    timeout -k 10 $((CAP_FLASHINFER + 20)) "$PY" -m metrale_attn check --out "$DECISIVE_OUT" --kv-dtype "$DECISIVE_KV" \
      --model "$DECISIVE_MODELS" --points "$DECISIVE_POINTS" --cells "$DECISIVE_CELLS" --impl flashinfer --flashinfer-status "$FI_STATUS" \
      --deadline-s "$CAP_FLASHINFER" </dev/null >"$WORK/flashinfer_check.log" 2>&1
    rc=$?
    n=$("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sum(x['impl']=='flashinfer' and x.get('median_us') is not None for x in r['timing']))" \
      "$DECISIVE_OUT/report.json" 2>/dev/null || echo 0)
    step flashinfer "$([ "${n:-0}" -gt 0 ] && echo ok || echo none)" "$(since "$t")" "rc=$rc; $n decisive cells timed on FlashInfer"
  else
    step flashinfer_jit skipped 0 "$NO_FLASHINFER"
    step flashinfer skipped 0 "$NO_FLASHINFER"
  fi
  checkpoint
fi

# -- the model probes and the L2 probe (the rerun) --------------------------------------------------
if [ "$PROFILE" = quick ]; then
  t=$(date +%s)
  say "model_probes.py (cap ${CAP_MODEL_PROBES}s)"
  timeout -k 10 "$CAP_MODEL_PROBES" "$PY" -m benchmarks.model_probes --out "$OUT/model_probes.json" "${CPUFLAG[@]}" \
    </dev/null >"$WORK/model_probes.log" 2>&1
  rc=$?
  grep -v $'^ok\t' "$WORK/model_probes.log" | tail -n 6
  out=$(tail -n 1 "$WORK/model_probes.log")
  case "$out" in ok$'\t'*) ;; *) out="FAIL"$'\t'"rc=$rc: $(tail -n 1 "$WORK/model_probes.log")" ;; esac
  step model_probes "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
fi
if [ "$PROFILE" = quick ] && [ "${L2_PROBE:-1}" = 1 ]; then
  t=$(date +%s)
  say "l2_probe.py (ncu, cap ${CAP_L2_PROBE}s)"
  timeout -k 10 $((CAP_L2_PROBE + 15)) "$PY" -m benchmarks.l2_probe probe --out "$WORK/l2_probe.json" --work "$WORK/l2_probe" \
    --timeout-s "$CAP_L2_PROBE" "${CPUFLAG[@]}" ${NCU:+--ncu "$NCU"} 2>"$WORK/l2_probe.err" | tee "$WORK/l2_probe.log"
  out=$(verdict json-status "$WORK/l2_probe.json")
  step l2_probe "${out%%$'\t'*}" "$(since "$t")" "${out#*$'\t'}"
  checkpoint
elif [ "$PROFILE" = quick ]; then
  step l2_probe skipped 0 "L2_PROBE=0"
fi

# -- 7. the sweep, with what the deadline leaves ------------------------------------------------------
t=$(date +%s)
if [ "$PROFILE" = quick ]; then LOOP_CAP=0; PDL_CAP=0; else
  LOOP_CAP=${DECODE_LOOP_CAP_S:-$CAP_DECODE_LOOP}; PDL_CAP=${PDL_CHECK_CAP_S:-$CAP_PDL_CHECK}; fi
BUDGET=$(clamp $(( DEADLINE_S - $(elapsed) - CAP_SUMMARY - LOOP_CAP - PDL_CAP )) 20 "${BENCH_BUDGET_S:-300}")
BENCH=(-m benchmarks.sweep --out-dir "$OUT" --env-json "$WORK/env.json" --time-budget-s "$BUDGET"
       --profile "$PROFILE" --probe-json "$WORK/l2_probe.json" --checkpoint-s "$CHECKPOINT_S" --sass-json "$SASS_JSON")
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

# -- 8. the decode loop: the serving path the vLLM backend shares, end to end on the device ---------
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

# -- 8b. the split-K merge with and without programmatic dependent launch, side by side -------------
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

# -- 9. summary (printed last) and logs --------------------------------------------------------
"$PY" -m benchmarks.summary --steps "$STEPS" --env "$WORK/env.json" ${json:+--bench "$json"} \
  --check "$DECISIVE_OUT/report.json" --sass-json "$SASS_JSON" --probe "$WORK/l2_probe.json" --mode "$MODE" \
  --out "$OUT/summary.md" --total-s "$(elapsed)" >"$WORK/summary.txt" 2>&1 || echo "summary.py failed" >>"$WORK/summary.txt"
pack_logs
cat "$WORK/summary.txt"
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
# Exit 0 when the run measured cells of ours (the decisive check's or the sweep's), 1 when not.
"$PY" -m benchmarks.steps exit-code ${json:+--json "$json"} --check "$DECISIVE_OUT/report.json" >/dev/null
