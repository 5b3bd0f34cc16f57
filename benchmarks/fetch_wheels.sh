#!/usr/bin/env bash
# fetch_wheels.sh: download, HERE (where PyPI is reachable), the wheels the GPU machine
# lacks, into .whl/ at the repository root (git-ignored). The GPU machine has no
# internet; a device run carries .whl/ and installs it first:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# The target is CPython 3.12 on x86-64 Linux (the device image's python3). The image
# already holds numpy, cupy-cuda13x, ml-dtypes, pytest, pytest-xdist, hypothesis,
# matplotlib, torch, ninja, filelock and nvidia-ml-py (the device tool's KINDS.md), and
# a carried copy of one of those would shadow it on PYTHONPATH (a carried pytest next
# to the image's pytest-xdist is a version clash waiting to happen), so only what the
# image lacks travels:
#
#   pytest-timeout       the GPU tests' per-test timeout (a hung device test costs its
#                        own time, not the step's); pure Python.
#   flashinfer-python, apache-tvm-ffi
#                        the FlashInfer baseline (optional; FLASHINFER=0 skips it).
#                        flashinfer-python 0.6.6 imports with apache-tvm-ffi plus
#                        packages the image has (requests, einops, cuda-bindings,
#                        filelock, nvidia-ml-py, ninja). Its cutlass-dsl /
#                        cudnn-frontend requirements are imported lazily by kernels the
#                        benchmark does not use; its kernels are compiled by its JIT
#                        (nvcc + ninja) on the device.
#
# Every version is pinned, one version of each package (two stop the whole install).
#
# Usage: bash benchmarks/fetch_wheels.sh   (FLASHINFER=0 to leave FlashInfer out)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"

WHEELS=(pytest-timeout==2.4.0)
if [ "${FLASHINFER:-1}" != 0 ]; then
  WHEELS+=(flashinfer-python==0.6.6 apache-tvm-ffi==0.1.9)
fi

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$DEST")
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done

"$PY" -m pip download -q "${args[@]}" "${WHEELS[@]}"

# Keep exactly the pinned versions: drop wheels of other versions left by earlier runs.
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  stem=$(echo "$name" | tr '-' '_')
  for f in "$DEST"/*.whl; do
    base=$(basename "$f")
    fname=$(echo "${base%%-*}" | tr '[:upper:]' '[:lower:]' | tr '-' '_')
    fver=$(echo "$base" | cut -d- -f2)
    if [ "$fname" = "$(echo "$stem" | tr '[:upper:]' '[:lower:]')" ] && [ "$fver" != "$version" ]; then
      echo "removing $base (not the pinned $version)"; rm -f "$f"
    fi
  done
done

ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
  echo "warning: more than 40 MiB; the working tree + carry must stay under 64 MiB" >&2
fi
