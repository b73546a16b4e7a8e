"""Benchmark: Gweights/s of the CPU dequantization kernels (llamatune.kernels.dequant).

One (1536, 512) matrix, the largest of the finetune bench shape, per GGML type with a
numba kernel, quantized by llamatune's own quantizer (so its scales are the normal
floats of a real model, not random bits); F16 and BF16 are the matrix cast; MXFP4 is
the gguf package's quantization; IQ4_NL and IQ4_XS, which nothing here quantizes, are
random codes under normal scales (a 4-bit code's cost does not depend on its value). Each
thread count runs in a fresh process with numba's thread count set before it loads.
The rate is the best of --repeat expansions after one warm-up (compilation excluded):
the least disturbed by other processes on a shared machine.

    python bench/dequant.py [--threads 1,2] [--repeat 300] [--types Q4_K,Q6_K] [--json]

`--device cuda` times the CUDA kernels instead (llamatune.kernels.cuda.dequant) on a
(11008, 4096) matrix, Llama-7B's largest: per call, the mean of --repeat launches
queued back to back (the kernel's own time) and the best of 20 launches each waited
for (launch included); GB/s counts the quantized bytes read and the float32 written.

    python bench/dequant.py --device cuda [--types Q4_K,Q6_K,Q8_0] [--repeat 200]
"""
from __future__ import annotations

import json
import time

from children import best_seconds, per_type_main, per_type_parser

ROWS, COLS = 1536, 512
TYPES = "F16,BF16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,MXFP4,IQ4_NL,IQ4_XS"


def data_of(name: str, x):
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from llamatune.kernels.quantize import quantize
    if name == "F16":
        return x.astype(np.float16).view(np.uint8)
    if name == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if name == "MXFP4":
        import gguf
        return gguf.quants.quantize(x, T.MXFP4)
    if name in ("IQ4_NL", "IQ4_XS"):
        from gguf import GGML_QUANT_SIZES
        block, size = GGML_QUANT_SIZES[T[name]]
        raw = np.random.default_rng(1).integers(0, 256, (x.shape[0], x.shape[1] // block, size), np.uint8)
        d = np.abs(x).max() / 127 / (1 if name == "IQ4_NL" else 31)
        raw[:, :, :2] = np.array([d], np.float16).view(np.uint8)
        return raw.reshape(x.shape[0], -1)
    return quantize(x, T[name])


def child(args) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as T

    import llamatune  # noqa: F401  (threading policy first)
    from llamatune.kernels.dequant import dequantize_into

    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    out = np.empty((ROWS, COLS), np.float32)
    rows = []
    for name in args.types:
        data, qtype = data_of(name, x), int(T[name])
        best = best_seconds(lambda: dequantize_into(data, qtype, out), args.repeat)
        rows.append(dict(threads=args.threads_child, type=name, us=round(best * 1e6, 1),
                         gweights_per_s=round(ROWS * COLS / best / 1e9, 2)))
    print(json.dumps(rows))


def cuda_rows(args) -> list[dict]:
    import numpy as np
    import cupy
    from gguf import GGMLQuantizationType as T

    from llamatune.backend import get_backend
    dequant = get_backend("cuda").ops.dequant
    rows_, cols = 11008, 4096
    x = np.random.default_rng(0).standard_normal((rows_, cols)).astype(np.float32)
    out = cupy.empty((rows_, cols), np.float32)
    sync = cupy.cuda.Device().synchronize
    rows = []
    for name in args.types:
        host, qtype = data_of(name, x), int(T[name])
        data = cupy.asarray(np.ascontiguousarray(host).reshape(rows_, -1))
        dequant.dequantize_into(data, qtype, out)  # compile
        sync()
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            dequant.dequantize_into(data, qtype, out)
        sync()
        queued = (time.perf_counter() - t0) / args.repeat
        waited = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            dequant.dequantize_into(data, qtype, out)
            sync()
            waited = min(waited, time.perf_counter() - t0)
        moved = data.nbytes + out.nbytes
        rows.append(dict(type=name, us=round(queued * 1e6, 1), us_waited=round(waited * 1e6, 1),
                         gb_per_s=round(moved / queued / 1e9, 1)))
    return rows


def main() -> None:
    ap = per_type_parser(__doc__, TYPES, threads="1,2", repeat=300)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    args.types = args.types.split(",")
    if args.device == "cuda":
        rows = cuda_rows(args)
        print("dequantize a (11008, 4096) matrix on the GPU: mean of queued launches, best waited one")
        print(f"{'type':>5} {'us':>8} {'waited us':>10} {'GB/s':>7}")
        for r in rows:
            print(json.dumps(r) if args.json else
                  f"{r['type']:>5} {r['us']:>8} {r['us_waited']:>10} {r['gb_per_s']:>7}")
        return
    per_type_main(__file__, args, child, f"dequantize a ({ROWS}, {COLS}) matrix; best of {args.repeat}",
                  [("threads", "threads", 7), ("type", "type", 5), ("us", "us", 8), ("gweights_per_s", "Gw/s", 7)])


if __name__ == "__main__":
    main()
