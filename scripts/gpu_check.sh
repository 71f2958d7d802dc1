#!/usr/bin/env bash
# One-shot check of the FlashInfer backend on a machine with one CUDA GPU (H200) and no internet.
# Run from anywhere; it works in the repo root. Needs: torch with CUDA already installed, the CUDA
# toolkit (nvcc) and a C++ compiler (FlashInfer 0.6 JIT-compiles its kernels on first use), and the
# wheels/ folder made by scripts/fetch_gpu_wheels.sh. Budget: under 8 minutes, JIT included.
#
#   scripts/gpu_check.sh            (PYTHON=/path/to/python to pick the interpreter)
#
# Steps (each prints its elapsed time; everything is logged to $OUT/gpu_check.log, or to
# benchmarks/out/gpu_check/ when OUT is unset, with pytest's junit XML and gpu_bench.json):
#   1. python + torch: torch.cuda.is_available() must be True, else a clear message and exit 2;
#   2. nvcc and c++ present (FlashInfer's JIT), else a clear message and exit 3;
#   3. offline install from wheels/ of each small dependency that is not importable yet (requests,
#      tqdm, packaging, ninja, click, einops, tabulate, sortedcontainers, xxhash, pytest, numpy,
#      setuptools>=77, transformers>=5.24); into the active venv/conda env, or else into a venv
#      with --system-site-packages (so the system's torch is used) at $RADIXCACHE_GPU_VENV
#      (default /tmp/radixcache-gpu-venv); exit 4 with the fetch option to use when one is missing;
#   4. pip install --no-deps --no-build-isolation -e . (PYTHONPATH also points at the repo);
#   5. flashinfer-python==0.6.18.post1 + apache-tvm-ffi + nvidia-ml-py with --no-deps (its declared
#      CUDA dependencies are not used by the paged wrappers), then `import flashinfer`;
#   6. JIT-compiles the 2 FlashInfer modules the tests and the benchmark need (two builds in
#      parallel; not fatal), then pytest -q -m gpu on the test files that carry the gpu mark
#      (collecting all of tests/ would import dev-only dependencies such as hypothesis): the
#      backend against the torch reference, generate_batch AND generate (cold prompt, cached turn
#      with a partial tail, left-padded batch) through FlashInfer against the torch backend;
#   7. python benchmarks/gpu_bench.py (torch vs flashinfer: tokens/s, TTFT p50, a cached
#      lm.generate turn's TTFT, max |logit diff|);
#   8. if at least 150 s of the budget (GPU_CHECK_BUDGET_S, default 460) are left: the
#      window/soft-cap, fp8 and MLA (K 192 / V 128 head dims) variant tests
#      (RADIXCACHE_GPU_VARIANTS=1; 3 more JIT modules),
#      else they are reported as skipped.
# Exit status: 0 when steps 6 and 7 (and 8 when it ran) passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-460}
RESULTS=${OUT:-$ROOT/benchmarks/out/gpu_check}
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
stage() { echo; echo "== [$(elapsed)s] $*"; }
die() { echo; echo "ERROR: $2"; echo "gpu_check: FAILED at $(elapsed)s"; exit "$1"; }
declare -A STATUS

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python

stage "1. python, torch, CUDA"
"$PY" - <<'EOF' || die 2 "cannot import torch with $PY: this check expects torch with CUDA preinstalled"
import platform, sys, torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "| built for CUDA", torch.version.cuda)
print("torch.cuda.is_available():", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
EOF
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || die 2 \
  "torch.cuda.is_available() is False: install a CUDA build of torch and make sure the GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES); nothing was installed"

stage "2. CUDA toolkit for FlashInfer's JIT"
NVCC=""
for cand in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc 2>/dev/null)" /usr/local/cuda/bin/nvcc; do
  if [[ -n "$cand" && -x "$cand" ]]; then NVCC=$cand; break; fi
done
[[ -n "$NVCC" ]] || die 3 "no nvcc found (CUDA_HOME, PATH, /usr/local/cuda): FlashInfer 0.6 compiles its attention kernels with the CUDA toolkit on first use; install it or set CUDA_HOME"
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
"$NVCC" --version | tail -2
command -v "${CXX:-c++}" >/dev/null 2>&1 || die 3 "no C++ compiler (${CXX:-c++}) for FlashInfer's JIT host code"
echo "CUDA_HOME=$CUDA_HOME; c++: $(command -v "${CXX:-c++}")"

stage "3. offline install of the dependencies from wheels/"
[[ -d wheels ]] || die 4 "no wheels/ folder: run scripts/fetch_gpu_wheels.sh on a machine with internet and copy wheels/ here"
if ! "$PY" -c "import os, sys; sys.exit(0 if sys.prefix != sys.base_prefix or os.environ.get('CONDA_PREFIX') else 1)"; then
  VENV=${RADIXCACHE_GPU_VENV:-/tmp/radixcache-gpu-venv}
  if [[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"; then
    PY=$VENV/bin/python
    echo "installing into the venv $VENV (it sees the system's torch)"
  else
    echo "WARNING: cannot create a venv; installing into $PY directly"
    export PIP_BREAK_SYSTEM_PACKAGES=1
  fi
fi
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"  # ninja
PIP=("$PY" -m pip install --no-index --find-links "$ROOT/wheels" --disable-pip-version-check -q)
# module:requirement pairs, each installed (with its own dependencies) only when it is missing
for pair in requests:requests tqdm:tqdm packaging:packaging ninja:ninja click:click einops:einops \
            tabulate:tabulate sortedcontainers:sortedcontainers xxhash:xxhash pytest:pytest \
            numpy:numpy; do
  mod=${pair%%:*}; req=${pair#*:}
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
    echo "installing $req"
    "${PIP[@]}" "$req" || {
      hint=""
      [[ $mod == numpy ]] && hint=" (scripts/fetch_gpu_wheels.sh --with-numpy)"
      die 4 "$req is not installed and not in wheels/$hint"; }
  fi
done
# pyproject's `license = "Apache-2.0"` (PEP 639) needs setuptools>=77 for the editable install
ST_OK="import sys, setuptools; from packaging.version import Version as V; sys.exit(V(setuptools.__version__) < V('77'))"
if ! "$PY" -c "$ST_OK" 2>/dev/null; then
  echo "installing setuptools>=77"
  "${PIP[@]}" "setuptools>=77" || echo "WARNING: no setuptools>=77 in wheels/; the editable install may fail (PYTHONPATH is used then)"
fi
TF_OK="import sys, transformers; from packaging.version import Version as V; v = V(transformers.__version__); print('transformers', v); sys.exit(0 if V('5.24') <= v < V('6') else 1)"
if ! "$PY" -c "$TF_OK" 2>/dev/null; then
  echo "installing transformers>=5.24,<6"
  "${PIP[@]}" "transformers>=5.24,<6" && "$PY" -c "$TF_OK" \
    || die 4 "radixcache needs transformers>=5.24,<6 and wheels/ has none (scripts/fetch_gpu_wheels.sh --with-transformers)"
fi

stage "4. install radixcache (editable, no deps)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"${PIP[@]}" --no-deps --no-build-isolation -e . || echo "WARNING: editable install failed; using PYTHONPATH=$ROOT"
"$PY" -c "import radixcache; print('radixcache', radixcache.__version__, 'from', radixcache.__file__)"

stage "5. install flashinfer-python 0.6.18.post1 from wheels/ (no deps)"
echo "pip will list cuda-python, cuda-tile, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl as"
echo "missing requirements: expected, the paged prefill/decode wrappers do not use them"
"${PIP[@]}" --no-deps flashinfer-python==0.6.18.post1 apache-tvm-ffi nvidia-ml-py \
  || die 4 "installing flashinfer-python from wheels/ failed (wheels fetched for another Python? see PY_VERSION in fetch_gpu_wheels.sh)"
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || die 4 "import flashinfer failed"
command -v ninja >/dev/null || die 4 "ninja is not on PATH (FlashInfer's JIT runs it)"

stage "6a. JIT-compile the two FlashInfer modules the tests and the benchmark use, in parallel"
# bf16, head_dim 64 and 128, no window/soft cap: the FA2 prefill module that serves both the
# prefill wrapper and the tensor-core decode wrapper (same arguments as their plan() passes).
# Not fatal: whatever is not built here is built by the first test that needs it.
half=$(( $(nproc) / 2 )); (( half > 0 )) || half=1
pids=()
for hd in 64 128; do
  MAX_JOBS=$half timeout $(( $(left) - 120 > 60 ? $(left) - 120 : 60 )) "$PY" -c "
import time, torch
from flashinfer.jit import gen_batch_prefill_module
t = time.time()
gen_batch_prefill_module('fa2', torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                         $hd, $hd, 0, False, False, False).build_and_load()
print('head_dim $hd module ready in %.0fs' % (time.time() - t))" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || echo "WARNING: prebuild $pid failed or timed out (the tests build on demand)"; done

export MAX_JOBS=${MAX_JOBS:-$(nproc)}
GPU_TESTS=$(grep -l "mark\.gpu" tests/test_*.py | tr '\n' ' ')

stage "6b. GPU tests: pytest -q -m gpu $GPU_TESTS"
t=$(( $(left) - 90 )); (( t > 60 )) || t=60
timeout "$t" "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  --junitxml="$RESULTS/pytest_gpu.xml" $GPU_TESTS
rc=$?; STATUS[tests]=$rc
(( rc == 124 )) && echo "TIMEOUT after ${t}s"

stage "7. benchmark: benchmarks/gpu_bench.py"
t=$(left); (( t > 30 )) || t=30
timeout "$t" "$PY" benchmarks/gpu_bench.py --out "$RESULTS"
rc=$?; STATUS[bench]=$rc
(( rc == 124 )) && echo "TIMEOUT after ${t}s"

stage "8. variant tests (sliding window + soft cap, fp8 pool, MLA head dims)"
t=$(left)
if (( t >= 150 )); then
  RADIXCACHE_GPU_VARIANTS=1 timeout "$t" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --junitxml="$RESULTS/pytest_gpu_variants.xml" tests/test_flashinfer.py -k "softcap or fp8 or mla"
  rc=$?; STATUS[variants]=$rc
  (( rc == 124 )) && echo "TIMEOUT after ${t}s"
else
  echo "skipped: only ${t}s of the ${BUDGET}s budget left (run: RADIXCACHE_GPU_VARIANTS=1 pytest -m gpu tests/test_flashinfer.py -k 'softcap or fp8 or mla')"
  STATUS[variants]=skipped
fi

echo
echo "== summary after $(elapsed)s"
failed=0
: > "$RESULTS/summary.txt"
for k in tests bench variants; do
  v=${STATUS[$k]:-not run}
  [[ $v == 0 ]] && v=passed
  [[ $v == 124 ]] && v="timed out"
  [[ $v == passed || $v == skipped ]] || { v="failed ($v)"; failed=1; }
  echo "$k: $v" | tee -a "$RESULTS/summary.txt"
done
echo "results in $RESULTS"
exit $failed
