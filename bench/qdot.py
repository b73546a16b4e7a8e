"""Benchmark: y = x W^T on the quantized blocks (llamatune.kernels.qdot) against today's
path (dequantize W to float32, then numpy's matmul), at Qwen2.5-0.5B's decode shapes.

Shapes (n_out x n_in) and the types the real model stores them in: attn_q/attn_output
896 x 896 (Q5_0), ffn_gate/ffn_up 4864 x 896 (Q5_0), ffn_down 896 x 4864 (Q4_K, Q6_K),
the output head 151936 x 896 (Q8_0, expanded 4864 rows at a time as the runner does);
`--all-types` times every type with a quantized product at every shape. x has G rows
(1: one decode step; 8: eight sequences decoded together). W is a float matrix quantized
by llamatune's quantizer (realistic scales), the head's rows tiled from 4864 of them.
The two paths alternate call by call; a figure is the best of --repeat calls after a
warm-up (the least disturbed on a shared machine) with the median beside it. Each
thread count runs in a fresh process with numba's and BLAS's thread counts set first.

    python bench/qdot.py [--threads 2] [--repeat 20] [--all-types] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from children import printed_as_json, rows_per_thread_count

SHAPES = [(896, 896, "Q5_0"), (4864, 896, "Q5_0"), (896, 4864, "Q4_K,Q6_K"), (151936, 896, "Q8_0")]
ALL = "Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K"
HEAD_ROWS = 4864           # the runner's head block at this model: its largest layer matrix's rows


def weight(n_out: int, n_in: int, name: str):
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from llamatune.kernels.quantize import quantize
    rows = min(n_out, HEAD_ROWS)
    w = np.random.default_rng(0).standard_normal((rows, n_in)).astype(np.float32) * np.float32(0.02)
    data = np.ascontiguousarray(quantize(w, T[name])).view(np.uint8).reshape(rows, -1)
    return np.ascontiguousarray(np.tile(data, (-(-n_out // rows), 1))[:n_out])


def timed_pair(qdot_call, f32_call, repeat: int):
    qdot_call(), f32_call()                       # compile, warm up
    q, f = [], []
    for _ in range(repeat):
        for call, times in ((qdot_call, q), (f32_call, f)):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return q, f


def child(args) -> None:
    import llamatune  # noqa: F401  (threading policy first: before numpy loads OpenBLAS)
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from llamatune.kernels.dequant import dequantize_into
    from llamatune.kernels.qdot import qdot_into

    rows = []
    for n_out, n_in, types in SHAPES:
        for name in (ALL if args.all_types else types).split(","):
            data, qtype = weight(n_out, n_in, name), int(T[name])
            block = min(n_out, HEAD_ROWS)
            scratch = np.empty((block, n_in), np.float32)
            for G in (1, 8):
                x = np.random.default_rng(1).standard_normal((G, n_in)).astype(np.float32)
                y, y32 = np.empty((G, n_out), np.float32), np.empty((G, n_out), np.float32)

                def f32_path():
                    for lo in range(0, n_out, block):
                        hi = min(n_out, lo + block)
                        dequantize_into(data[lo:hi], qtype, scratch[: hi - lo])
                        np.matmul(x, scratch[: hi - lo].T, out=y32[:, lo:hi])

                q, f = timed_pair(lambda: qdot_into(y, x, data, qtype), f32_path, args.repeat)
                macs = n_out * n_in * G
                rows.append(dict(threads=args.threads_child, shape=f"{n_out}x{n_in}", type=name, G=G,
                                 qdot_ms=round(min(q) * 1e3, 3), qdot_median_ms=round(statistics.median(q) * 1e3, 3),
                                 f32_ms=round(min(f) * 1e3, 3), f32_median_ms=round(statistics.median(f) * 1e3, 3),
                                 qdot_gmacs=round(macs / min(q) / 1e9, 2), f32_gmacs=round(macs / min(f) / 1e9, 2),
                                 max_rel_diff=float(np.abs(y - y32).max() / np.abs(y32).max())))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--all-types", action="store_true", help="every type at every shape")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads_child:
        child(args)
        return
    rows = rows_per_thread_count(__file__, args.threads, ["--repeat", str(args.repeat)]
                                 + (["--all-types"] if args.all_types else []))
    if printed_as_json(rows, args.json):
        return
    print(f"y = x W^T, x (G, n_in); best (median) of {args.repeat} alternating calls; GMAC/s of the best")
    print(f"{'thr':>3} {'shape':>11} {'type':>5} {'G':>2} {'qdot ms':>16} {'deq+f32 ms':>16} "
          f"{'qdot GMAC/s':>11} {'f32 GMAC/s':>10} {'speed-up':>8} {'max rel diff':>12}")
    for r in rows:
        print(f"{r['threads']:>3} {r['shape']:>11} {r['type']:>5} {r['G']:>2} "
              f"{r['qdot_ms']:>7.3f} ({r['qdot_median_ms']:>6.3f}) {r['f32_ms']:>7.3f} ({r['f32_median_ms']:>6.3f}) "
              f"{r['qdot_gmacs']:>11} {r['f32_gmacs']:>10} {r['f32_ms'] / r['qdot_ms']:>7.2f}x {r['max_rel_diff']:>12.2e}")


if __name__ == "__main__":
    main()
