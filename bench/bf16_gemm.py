"""Benchmark: bf16 products through oneDNN against numpy's float32 product (GFLOP/s).

For each (M, K) x (K, N) of issue #29, in one process, rounds alternate: numpy f32
`a @ b`, then kernels.bf16.gemm with b (K, N) and with b (N, K) transposed (the
training layouts: dy @ W and x @ W^T), then, with --api, oneDNN's BLAS-like
`dnnl_gemm_bf16bf16f32` on the same bf16 operands. Each cell is the best and the worst
round (GFLOP/s, the spread a shared machine gives). `a->bf16` is the rate of
converting the a operand (to_bf16, Gvalues/s), which a training product pays on top.
The header names numpy's BLAS kernel (threadpoolctl: OPENBLAS_CORETYPE picks it),
oneDNN's version and the kernel it picked (ONEDNN_VERBOSE=1 shows the same per call).

    python bench/bf16_gemm.py [--rounds 5] [--shapes 0,1,2] [--api] [--threads N]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import llamatune  # noqa: F401  (before numpy: its threading policy, OPENBLAS_THREAD_TIMEOUT among it,
#                   is read when OpenBLAS loads; OpenBLAS's default spin after each numpy
#                   product took a core from the next bf16 product: 200 against 404 GFLOP/s
#                   at (2048, 512) x (512, 1536) on 2 Zen 4 cores)
import numpy as np

SHAPES = [(2048, 512, 1536), (2048, 512, 32000), (512, 896, 4864), (512, 4096, 11008),
          (2048, 4096, 4096)]  # (M, K, N)


def gemm_api(bf16):
    """oneDNN's dnnl_gemm_bf16bf16f32 (row-major) through ctypes, as f(out, a, b)."""
    lib = bf16._library().lib
    f = lib.dnnl_gemm_bf16bf16f32
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, ctypes.c_float, vp, i64, vp, i64,
                  ctypes.c_float, vp, i64]

    def run(out, a, b):
        (M, K), N = a.shape, b.shape[1]
        assert f(b"N", b"N", M, N, K, 1.0, a.ctypes.data, K, b.ctypes.data, N, 0.0, out.ctypes.data, N) == 0
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))),
                    help="indices into the shape list")
    ap.add_argument("--api", action="store_true", help="also time dnnl_gemm_bf16bf16f32")
    ap.add_argument("--threads", type=int, default=0, help="numba (and so oneDNN) threads")
    args = ap.parse_args()

    import numba
    from threadpoolctl import threadpool_info

    from llamatune.kernels import bf16
    if args.threads:
        numba.set_num_threads(args.threads)
    if not bf16.available():
        raise SystemExit(f"bf16_gemm: {bf16.unavailable_reason()}")
    blas = [f"{i.get('internal_api')} {i.get('architecture')} x{i.get('num_threads')}"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print(f"numpy {np.__version__} BLAS: {', '.join(blas)} (OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE', 'unset')}, OPENBLAS_L2_SIZE="
          f"{os.environ.get('OPENBLAS_L2_SIZE', 'unset')}); oneDNN {bf16.library_version()}, "
          f"{numba.get_num_threads()} threads; CPU bf16 flags: {' '.join(bf16.cpu_bf16_flags()) or 'none'}")
    api = gemm_api(bf16) if args.api else None
    rng = np.random.default_rng(0)
    head = "| (M, K) x (K, N) | numpy f32 | bf16 b (K,N) | bf16 b^T (N,K) |"
    head += " gemm API |" if api else ""
    print(head + " ratio (best) | a->bf16 Gv/s | oneDNN kernel |")
    print("|" + "---|" * (head.count("|") + 2))
    for idx in (int(s) for s in args.shapes.split(",")):
        M, K, N = SHAPES[idx]
        a32 = rng.standard_normal((M, K), dtype=np.float32)
        b32 = rng.standard_normal((K, N), dtype=np.float32)
        a, b = np.empty((M, K), np.uint16), np.empty((K, N), np.uint16)
        bf16.to_bf16(a, a32)
        bf16.to_bf16(b, b32)
        bt = np.ascontiguousarray(b.T)
        out = np.empty((M, N), np.float32)
        runs = {"f32": lambda: np.matmul(a32, b32, out=out),
                "bf16": lambda: bf16.gemm(out, a, b),
                "bf16T": lambda: bf16.gemm(out, a, bt, trans_b=True)}
        if api:
            runs["api"] = lambda: api(out, a, b)
        runs["conv"] = lambda: bf16.to_bf16(a, a32)
        times = {k: [] for k in runs}
        for f in runs.values():  # warm: JIT, primitive creation, pages
            f()
        for _ in range(args.rounds):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        gf = 2 * M * N * K / 1e9
        cell = {k: f"{gf / min(v):.0f} ({gf / max(v):.0f})" for k, v in times.items()}
        best_bf = min(min(times["bf16"]), min(times["bf16T"]))
        row = f"| ({M}, {K}) x ({K}, {N}) | {cell['f32']} | {cell['bf16']} | {cell['bf16T']} |"
        row += f" {cell['api']} |" if api else ""
        row += (f" {min(times['f32']) / best_bf:.2f}x | {M * K / min(times['conv']) / 1e9:.2f} |"
                f" {bf16.implementation(M, N, K)} / {bf16.implementation(M, N, K, trans_b=True)} |")
        print(row, flush=True)
    print("cells: GFLOP/s of the best round (worst round in brackets); ratio: best f32 time over "
          "the best bf16 time of either layout")


if __name__ == "__main__":
    main()
