#!/usr/bin/env bash
# The CUDA path on a real GPU, in one run: versions, the CUDA tests, the CLI against the
# CPU on llama.cpp's reference models, and the GPU bench. Each stage has its own time
# limit and a failed stage does not stop the next; logs go to $OUT (default ./gpu-check).
#
#   bash bench/gpu_check.sh [SHARED_DIR]
#
# SHARED_DIR holds models/tiny-Q4_K_M.gguf, models/tiny-Q2_K.gguf and
# data/shakespeare-eval.txt (default ../shared); the CLI stage is skipped without them.
# Wheels in .whl/ (a machine without a registry: gguf, and llamatune built with
# `pip wheel --no-deps . -w .whl`) are installed to /tmp/site first; otherwise the
# llamatune installed in the environment is used. Variables: OUT, PYTEST_S and BENCH_S (stage
# time limits), WORKERS (pytest-xdist), BENCH_ARGS, NO_BENCH=1 (skip the bench), STAGES (the
# stages to run, default "launches tests cli bench"), BASE_WHL (a folder with an earlier llamatune
# wheel: the launch count and the bench also run it, installed to /tmp/site-base, the bench with
# BASE_BENCH_ARGS, as a baseline measured on the same GPU in the same call).
#
# Before/after in one call (launches per step and tokens/s of the earlier wheel and this one):
#   pip wheel --no-deps . -w .whl
#   git archive BASE_COMMIT | tar -x -C /tmp/base && pip wheel --no-deps /tmp/base -w base-whl
#   BASE_WHL=base-whl BENCH_ARGS="--layers 4 --steps 3 --types q4_k --modes tf32 --ckpt layer,selective" \
#     BASE_BENCH_ARGS="--layers 4 --steps 3 --types q4_k --modes tf32 --ckpt layer,selective" bash bench/gpu_check.sh
# The launch stage counts in numba's CUDA simulator (the code path's launches: numba-cuda kernels,
# CuPy ops and cuBLAS products of one step of a 1-layer model); where Nsight Systems (`nsys`) is
# installed it also counts the kernels the GPU ran in a 2-step tiny bench, per wheel.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
SHARED=$(cd "${1:-../shared}" 2>/dev/null && pwd) || SHARED=${1:-../shared}   # absolute: stages cd elsewhere
REPO=$PWD
PY=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  export PATH=/tmp/site/bin:$PATH
fi

stage() { echo; echo "=== $1 ($(date +%T))"; }

stage versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cd /tmp     # not the repository root, whose llamatune/ would shadow the installed package
$PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("numpy", "numba", "numba_cuda", "cupy", "gguf", "llamatune", "torch", "peft"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
import llamatune.kernels.cuda as kc
print("cuda available:", kc.is_available(), "simulator:", kc.simulator_enabled())
EOF
cd "$REPO"

STAGES=${STAGES:-launches tests cli bench}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

if has launches; then
  if [ -n "${BASE_WHL:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base \
      "$BASE_WHL"/llamatune-*.whl
  fi
  for arch in llama qwen3; do
    for which in base now; do
      [ $which = base ] && [ -z "${BASE_WHL:-}" ] && continue
      stage "launches per step, $arch, $which (simulator)"
      site=$([ $which = base ] && echo /tmp/site-base: || echo "")
      (cd /tmp && PYTHONPATH=$site${PYTHONPATH:-} NUMBA_ENABLE_CUDASIM=1 timeout 300 $PY "$REPO/bench/cuda_launches.py" \
         --arch $arch 2>&1 | tee "$OUT/launches-$arch-$which.txt")
    done
  done
  if command -v nsys >/dev/null; then
    for which in base now; do
      [ $which = base ] && [ -z "${BASE_WHL:-}" ] && continue
      stage "GPU kernels of a 2-step tiny bench, $which (nsys)"
      site=$([ $which = base ] && echo /tmp/site-base: || echo "")
      PYTHONPATH=$site${PYTHONPATH:-} timeout 300 nsys profile -t cuda -o "$OUT/nsys-$which" --force-overwrite true \
        $PY bench/gpu_finetune.py --shape tiny --steps 2 --types q8_0 --modes fp32 --ckpt selective \
        --workdir /tmp/gpu-bench-tiny --out "$OUT/tiny-$which.json" >/dev/null 2>&1
      nsys stats -r cuda_gpu_kern_sum "$OUT/nsys-$which.nsys-rep" 2>/dev/null | tee "$OUT/nsys-kernels-$which.txt" | tail -25
    done
  fi
fi

if has tests; then
stage "CUDA tests (pytest -m cuda --slow)"
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")    # pytest-xdist where installed
TESTS=$REPO
if [ -n "${PYTHONPATH:-}" ]; then
  # the installed wheels: the tests run from a copy without the sources, whose llamatune/ (without
  # kernels/) would shadow the wheel through pyproject's pythonpath "." (No module named
  # 'llamatune.kernels'); ../shared of the copy is SHARED
  TESTS=/tmp/llamatune-tests
  rm -rf "$TESTS" && mkdir -p "$TESTS" && cp -r tests checks bench configs pyproject.toml README.md "$TESTS"/
  [ -d "$SHARED" ] && ln -sfn "$SHARED" "$(dirname "$TESTS")/shared"
fi
(cd "$TESTS/tests" && timeout "${PYTEST_S:-240}" $PY -m pytest -m cuda --slow -rs $XDIST -p no:cacheprovider \
   --durations=10 2>&1 | tee "$OUT/pytest-cuda.log" | tail -40)
fi

if has cli && [ -f "$SHARED/models/tiny-Q4_K_M.gguf" ]; then
  stage "perplexity: llama.cpp reference models, cuda against cpu"
  for m in Q4_K_M Q2_K; do
    for d in cuda cpu; do
      echo "--- tiny-$m --device $d"
      timeout 120 llamatune perplexity -m "$SHARED/models/tiny-$m.gguf" -f "$SHARED/data/shakespeare-eval.txt" \
        --ctx 256 --device $d 2>&1 | tail -2
    done
  done
  stage "finetune 12 steps of tiny-Q4_K_M: cuda in f32, tf32 and bf16 products, cpu in f32"
  for d in cuda-f32 cuda-tf32 cuda-bf16 cpu-f32; do
    rm -rf "/tmp/ft-$d"; mkdir -p "/tmp/ft-$d"
    (cd "/tmp/ft-$d" && timeout 150 llamatune finetune --model-base "$SHARED/models/tiny-Q4_K_M.gguf" \
      --train-data "$SHARED/data/shakespeare-eval.txt" --lora-r 8 --ctx 64 --batch 4 --adam-iter 12 --seed 1 \
      --device "${d%-*}" --compute-dtype "${d#*-}" --lora-out "lora-$d.gguf" --save-every 0 \
      > log.txt 2>&1; echo "$d: exit $?"; grep -E "^compute:" log.txt; tail -3 log.txt)
  done
  (cd /tmp && $PY - <<'EOF'
import numpy as np
from gguf import GGUFReader
cpu = {t.name: np.array(t.data, np.float32) for t in GGUFReader("/tmp/ft-cpu-f32/lora-cpu-f32.gguf").tensors}
for d in ("cuda-f32", "cuda-tf32", "cuda-bf16"):
    got = {t.name: np.array(t.data, np.float32) for t in GGUFReader(f"/tmp/ft-{d}/lora-{d}.gguf").tensors}
    worst = max((float(np.abs(got[n] - w).max() / (np.abs(w).max() + 1e-30)), n) for n, w in cpu.items())
    print(f"adapter {d} vs cpu after 12 steps: {len(cpu)} tensors, worst max|diff|/max|cpu| = {worst[0]:.2e} ({worst[1]})")
EOF
  )
fi

if has bench && [ -z "${NO_BENCH:-}" ]; then
  if [ -n "${BASE_WHL:-}" ]; then
    stage "bench baseline: $(ls "$BASE_WHL"/llamatune-*.whl)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base \
      "$BASE_WHL"/llamatune-*.whl && \
    PYTHONPATH=/tmp/site-base:/tmp/site timeout "${BENCH_S:-300}" $PY bench/gpu_finetune.py \
      ${BASE_BENCH_ARGS:---layers 4 --steps 3 --types q4_k --modes tf32 --ckpt layer} \
      --workdir /tmp/gpu-bench --out "$OUT/gpu-bench-base.json" 2>&1 | grep -v "done, "
  fi
  stage "bench/gpu_finetune.py (7B-shaped layers)"
  timeout "${BENCH_S:-360}" $PY bench/gpu_finetune.py ${BENCH_ARGS:---layers 4 --steps 3 --types q4_k --modes bf16 --ckpt layer,selective,none --torch bf16} \
    --workdir /tmp/gpu-bench --out "$OUT/gpu-bench.json" 2>&1 | grep -v "done, "
fi
stage done
