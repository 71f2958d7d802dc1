#!/usr/bin/env bash
# Download, on a machine with access to PyPI, the wheels that scripts/gpu_check.sh installs on an
# offline GPU machine (Linux x86_64, CPython 3.11 by default) into wheels/ at the repo root.
#
#   scripts/fetch_gpu_wheels.sh [--with-numpy] [--with-transformers]
#
# Always (about 23 MiB):
#   flashinfer-python==0.6.18.post1, without its declared dependencies: cuda-python, cuda-tile,
#     nccl4py, nvidia-cudnn-frontend and nvidia-cutlass-dsl are CUDA/compiled packages that the
#     paged prefill/decode wrappers never import (torch with CUDA is expected on the GPU machine);
#   what `import flashinfer` and its kernel JIT need besides torch: apache-tvm-ffi (loads the
#     compiled modules), nvidia-ml-py (pynvml, pure Python), requests, tqdm, packaging, ninja (the
#     JIT build tool); its other small pure-Python dependencies: click, einops, tabulate;
#   radixcache's own small dependencies and the test runner: sortedcontainers, xxhash, pytest,
#     setuptools>=77 (the offline editable install: pyproject uses a PEP 639 license string).
# --with-numpy        adds numpy (about 16 MiB), if the GPU machine's torch comes without it.
# --with-transformers adds transformers>=5.24,<6 and its dependencies except numpy (about 27 MiB),
#                     if the GPU machine does not have it.
# Never: torch, nvidia-* CUDA libraries (nvidia-ml-py is the NVML Python binding, 50 KB).
# The total is printed; keep it under 60 MiB (all three together are about 66 MiB: use at most one
# of the two options). Override the interpreter with PYTHON=..., the target Python with
# PY_VERSION=3.12, the folder with WHEELS_DIR=....
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_NUMPY=0
WITH_TRANSFORMERS=0
for arg in "$@"; do
  case "$arg" in
    --with-numpy) WITH_NUMPY=1 ;;
    --with-transformers) WITH_TRANSFORMERS=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown option: $arg (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DEST=${WHEELS_DIR:-wheels}
PY_VERSION=${PY_VERSION:-3.11}
mkdir -p "$DEST"

platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
download() {
  local log rc=0
  log=$(mktemp)
  "$PYTHON" -m pip download --disable-pip-version-check -q --only-binary=:all: \
    --implementation cp --python-version "$PY_VERSION" "${platforms[@]}" -d "$DEST" "$@" \
    >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location '.*' is ignored" "$log" || true
  rm -f "$log"
  if (( rc != 0 )); then echo "ERROR: pip download $* failed" >&2; exit "$rc"; fi
}

echo "downloading into $DEST/ for CPython $PY_VERSION, Linux x86_64 (pip: $PYTHON)"
download --no-deps flashinfer-python==0.6.18.post1 \
  "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0" nvidia-ml-py
download requests tqdm packaging ninja click einops tabulate \
  "sortedcontainers>=2.4" "xxhash>=3.0" "pytest>=8" "setuptools>=77"
if [[ $WITH_NUMPY == 1 ]]; then
  download --no-deps numpy
fi
if [[ $WITH_TRANSFORMERS == 1 ]]; then
  download "transformers>=5.24,<6"
  [[ $WITH_NUMPY == 1 ]] || rm -f "$DEST"/numpy-*.whl
fi

bad=$(ls "$DEST" | grep -E '^(torch|triton|nvidia_(cu|nccl|cud|cutlass|nvjit|nvtx|cusparse)|cuda_)' || true)
if [[ -n "$bad" ]]; then
  echo "ERROR: large CUDA packages slipped in (remove them): $bad" >&2
  exit 1
fi
echo
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo
awk -v n="$(ls "$DEST"/*.whl | wc -l)" -v b="$total" 'BEGIN { printf "total: %d wheels, %.1f MiB\n", n, b / 1048576 }'
if (( total > 60 * 1048576 )); then
  echo "WARNING: more than 60 MiB; drop --with-numpy or --with-transformers" >&2
fi
