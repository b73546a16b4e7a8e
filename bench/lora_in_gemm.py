"""Benchmark: an adapter's forward share inside the bf16 base product (split bf16, "bf16x3").

A linear with an adapter in two passes over y (N, n_out): the base product
y = bf16(x) bf16(W)^T through oneDNN, then the adapter's float32 share y += (s xa) B^T
(kernels/lora.py `lora_forward_onednn`), a read and a write of y. Against the way a bf16
training step computes it (models/products.py `Products.adapted`): each float32 factor
split into two bf16 parts, v = hi + lo with hi = bf16(v), lo = bf16(v - hi) (exact to
2^-17 of v), and the three products that matter appended to the base product's K axis:

    y = [bf16(x) | xs_hi | xs_hi | xs_lo] [bf16(W) | B_hi | B_lo | B_hi]^T,  xs = s xa

one AMX product with float32 accumulation (a bf16 x bf16 product is exact in float32),
K grown by 3r (padded with zeros to a multiple of 32, AMX's tile depth). Reported for each width: the adapter share's error against float64
(relative to its largest element) for the float32 pass and for the split; the times
of base + float32 pass, of the extended product alone, of the copies that build its
operands here (the graph writes x's rounding and W's dequantization straight into the
extended buffers), and of the base product alone; medians of --repeat interleaved rounds (each the
median of 3 calls).

    python bench/lora_in_gemm.py [--N 2048] [--K 512] [--widths 1536,512] [--r 8] [--repeat 30]
"""
from __future__ import annotations

import argparse
import time

import llamatune  # noqa: F401  (the threading policy's environment, before numpy loads)
import numpy as np

from llamatune.kernels import bf16


def rounded(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, np.uint16)
    bf16.to_bf16(out, np.ascontiguousarray(x, np.float32))
    return out


def widened(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape, np.float32)
    bf16.from_bf16(out, np.ascontiguousarray(b))
    return out


def split(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = rounded(v)
    return hi, rounded(v - widened(hi))


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--K", type=int, default=512)
    ap.add_argument("--widths", default="1536,512")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    N, K, r = a.N, a.K, a.r
    rng = np.random.default_rng(0)
    print(f"oneDNN {bf16.library_version()}; N {N}, K {K}, r {r}; times in ms (medians of {a.repeat} rounds)")
    print("| n_out | share error: f32 pass | split in product | base + f32 pass | extended product "
          "| its operand copies | base alone | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for n_out in map(int, a.widths.split(",")):
        x = rng.standard_normal((N, K), dtype=np.float32)
        W = rng.standard_normal((n_out, K), dtype=np.float32) * np.float32(0.02)
        A = rng.standard_normal((r, K), dtype=np.float32) * np.float32(0.02)
        B = rng.standard_normal((n_out, r), dtype=np.float32) * np.float32(1e-3)
        xs = (x @ A.T) * np.float32(2.0)
        x16, W16 = rounded(x), rounded(W)
        base64 = widened(x16).astype(np.float64) @ widened(W16).astype(np.float64).T
        share64 = xs.astype(np.float64) @ B.T.astype(np.float64)
        scale = np.abs(share64).max()

        y = np.empty((N, n_out), np.float32)

        def today():
            bf16.gemm(y, x16, W16, trans_b=True)
            bf16.gemm(y, xs, B, trans_b=True, accumulate=True)

        xh, xl = split(xs)
        bh, bl = split(B)
        E = -(-(K + 3 * r) // 32) * 32            # K + 3r padded with zeros to AMX's 32-deep tiles
        xe = np.zeros((N, E), np.uint16)
        We = np.zeros((n_out, E), np.uint16)

        def build():
            xe[:, :K], We[:, :K] = x16, W16
            for j, (xp, bp) in enumerate(((xh, bh), (xh, bl), (xl, bh))):
                xe[:, K + j * r:K + (j + 1) * r], We[:, K + j * r:K + (j + 1) * r] = xp, bp

        ye = np.empty((N, n_out), np.float32)

        def extended():
            bf16.gemm(ye, xe, We, trans_b=True)

        yb = np.empty((N, n_out), np.float32)

        def base():
            bf16.gemm(yb, x16, W16, trans_b=True)

        today()
        build()
        extended()
        err_f32 = np.abs((y - base64) - share64).max() / scale
        err_split = np.abs((ye - base64) - share64).max() / scale
        times = [[] for _ in range(4)]
        for _ in range(a.repeat):                  # interleaved: the machine's rate drifts
            for j, f in enumerate((today, extended, build, base)):
                times[j].append(median_ms(f, 3))
        times = [float(np.median(t)) for t in times]
        print(f"| {n_out} | {err_f32:.1e} | {err_split:.1e} | " + " | ".join(f"{t:.2f}" for t in times)
              + f" | {bf16.implementation(N, n_out, E, trans_b=True)} |")


if __name__ == "__main__":
    main()
