#!/usr/bin/env bash
# fetch_wheels.sh: download, HERE (where PyPI is reachable), the wheels the GPU machine
# lacks, into .whl/ at the repository root (git-ignored). The GPU machine has no
# internet; a device run carries .whl/ and installs it first:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# The target is CPython 3.12 on x86-64 Linux (the device image's python3). Every
# version is pinned and there is one version of each package (two versions of one
# package in .whl/ stop the whole install). What each is for:
#
#   ml_dtypes            bf16 / fp8 NumPy dtypes (the package's one runtime dependency
#                        besides NumPy; CuPy 14's bf16 goes through it)
#   hypothesis, attrs, sortedcontainers
#                        the test suite's property tests (hypothesis needs the other two)
#   pytest, pluggy, iniconfig, packaging, pygments
#                        pytest and its requirements, in case the image lacks them
#   flashinfer-python, apache-tvm-ffi, filelock, nvidia-ml-py, ninja
#                        the FlashInfer baseline (optional; FLASHINFER=0 skips it).
#                        flashinfer-python 0.6.6 imports with these plus packages the
#                        image has (requests, einops, cuda-bindings); filelock,
#                        nvidia-ml-py and ninja are on the image too but travel anyway
#                        (small). Its cutlass-dsl / cudnn-frontend requirements are
#                        imported lazily by kernels the benchmark does not use. Its
#                        kernels are compiled by its JIT (nvcc + ninja) on the device.
#
# Usage: bash benchmarks/fetch_wheels.sh   (FLASHINFER=0 to leave FlashInfer out)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"

WHEELS=(
  ml_dtypes==0.6.0
  hypothesis==6.170.17
  attrs==26.1.0
  sortedcontainers==2.4.0
  pytest==9.2.0
  pluggy==1.7.0
  iniconfig==2.3.1
  packaging==26.4
  pygments==2.21.0
)
if [ "${FLASHINFER:-1}" != 0 ]; then
  WHEELS+=(flashinfer-python==0.6.6 apache-tvm-ffi==0.1.9 filelock==4.3.1 nvidia-ml-py==13.615.71 ninja==1.13.2)
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
