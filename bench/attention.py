"""Benchmark: GFLOP/s of the CPU attention kernels (llamatune.kernels.attention, and
with `--dtype f32,bf16` kernels/attention_bf16.py, whose products run in bf16).

Shapes: the finetune bench shape B=8, NH=8, NKV=4, HS=64 at T=256 and T=1024, and
the same with packed rows (`segments`: samples of T/4 tokens each, attention
confined to each sample). Each thread count runs in a fresh process with numba's
and OpenBLAS's thread counts set before they load.

FLOPs counted are the useful causal ones: forward QK^T and PV over the visible
(query, key) pairs, 4 * HS FLOPs per pair and head; backward recomputes QK^T and
does dP, dQ, dK, dV: 10 * HS per pair and head. Packed rows have fewer visible
pairs, so their GFLOP/s says how well the kernels skip what a sample cannot see.
Times are the median of --repeat runs after one warm-up (compilation excluded); the
dtypes of one shape run one after the other in the same process.

    python bench/attention.py [--threads 1,2] [--T 256,1024] [--dtype f32,bf16] [--repeat 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

from children import printed_as_json, rows_per_thread_count

B, NH, NKV, HS = 8, 8, 4, 64


def visible_pairs(T: int, seg_len: int | None) -> int:
    runs = [T] if seg_len is None else [min(seg_len, T - s) for s in range(0, T, seg_len)]
    return sum(n * (n + 1) // 2 for n in runs)


def measure(T: int, seg_len: int | None, repeat: int, dtype: str = "f32") -> dict:
    import llamatune  # noqa: F401  (threading policy first: before numpy loads OpenBLAS)
    import numpy as np
    if dtype == "bf16":
        from llamatune.kernels import attention_bf16 as attention
    else:
        from llamatune.kernels import attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, NH, HS), np.float32)
    k = rng.standard_normal((B, T, NKV, HS), np.float32)
    v = rng.standard_normal((B, T, NKV, HS), np.float32)
    dout = rng.standard_normal((B, T, NH, HS), np.float32)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T), np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    seg = None
    if seg_len is not None:
        seg = np.broadcast_to((np.arange(T) // seg_len).astype(np.int32), (B, T)).copy()
    kw = {} if seg is None else {"segments": seg}

    def fwd():
        attention.attention_forward(out, lse, q, k, v, 0, **kw)

    def bwd():
        attention.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, **kw)

    res = {}
    pairs = visible_pairs(T, seg_len) * B * NH
    for name, fn, flops in (("fwd", fwd, 4 * HS * pairs), ("bwd", bwd, 10 * HS * pairs)):
        fn()  # compile / warm up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        res[name + "_ms"] = round(t * 1e3, 2)
        res[name + "_gflops"] = round(flops / t / 1e9, 2)
    return res


def child(args) -> None:
    rows = []
    for T in args.T:
        for seg_len in (None, T // 4):
            for dtype in args.dtype:
                r = dict(threads=args.threads_child, T=T, packed=seg_len is not None, dtype=dtype)
                r.update(measure(T, seg_len, args.repeat, dtype))
                rows.append(r)
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--T", default="256,1024", help="comma-separated sequence lengths")
    ap.add_argument("--dtype", default="f32", help="comma-separated: f32 (BLAS products), "
                    "bf16 (oneDNN bf16 products: pip install 'llamatune[cpu-bf16]')")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.T = [int(t) for t in args.T.split(",")]
    args.dtype = args.dtype.split(",")
    if args.threads_child:
        child(args)
        return
    rows = rows_per_thread_count(__file__, args.threads, ["--T", ",".join(map(str, args.T)),
                                                          "--dtype", ",".join(args.dtype),
                                                          "--repeat", str(args.repeat)])
    if printed_as_json(rows, args.json):
        return
    print(f"attention B={B} NH={NH} NKV={NKV} HS={HS} (packed: samples of T/4 tokens)")
    print(f"{'threads':>7} {'T':>5} {'packed':>6} {'dtype':>5} {'fwd ms':>8} {'fwd GF/s':>9} {'bwd ms':>8} "
          f"{'bwd GF/s':>9}")
    for r in rows:
        print(f"{r['threads']:>7} {r['T']:>5} {str(r['packed']):>6} {r['dtype']:>5} {r['fwd_ms']:>8} "
              f"{r['fwd_gflops']:>9} {r['bwd_ms']:>8} {r['bwd_gflops']:>9}")


if __name__ == "__main__":
    main()
