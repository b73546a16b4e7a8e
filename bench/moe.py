"""Benchmark: forward + backward of the grouped expert SwiGLU (kernels/moe.py's numba
path) against a dense SwiGLU FFN with the same active parameters, CPU, float32.

Shapes are Qwen3-30B-A3B's (config.json): embd 2048, 128 experts, 8 active per token,
expert ffn 768; the dense FFN has ffn 8 * 768 = 6144, so both do the same flops per
token. N tokens (default 512) routed by a random router (every expert gets about
N * 8 / 128 rows). The weights are frozen, as in LoRA training: backward gives dx and
the router weights' gradient (MoE) or dx (dense), no weight gradients.

Timed, each the median of --repeat rounds after a warm-up (compilation excluded):
* moe: moe_ffn_forward + moe_ffn_backward (the router excluded: timed as `router`,
  forward + backward of the 128-way softmax top-8);
* moe+lora: the same with rank --rank LoRA on the gate, up and down experts
  (A, B per expert, llama.cpp's build_lora_mm_id layout), their gradients included;
* dense: x W_gate^T, x W_up^T (BLAS), kernels/swiglu.py, h W_down^T and the backward.
The ops run in alternation within each round (the cores may be shared), so a change
in the machine's load falls on all of them alike. The expert weights take 2.4 GB
(float32); each pass reads all of them, the dense FFN reads 151 MB.

With Q4_K weights (`... q4_k`, random blocks as bench/real_size.py writes them) every
expert (and each dense matrix) is dequantized into one scratch right before its
product, as training does: the MoE then dequantizes 16 times the dense FFN's weights.

Measured on 2 shared cores of an Intel Xeon with AMX (load average 10 on
them), 512 tokens, 2 threads, `python bench/moe.py --tokens 512 --repeat 3`:
           op     fwd ms    bwd ms    total  / dense
          moe     2036.8    2334.6     4371     2.11
     moe+lora     2217.2    2426.9     4644     2.24
        dense      995.0    1074.6     2070     1.00
       router        5.7       0.3        6
     moe q4_k     1853.0    2167.0     4020     1.89
moe+lora q4_k     2274.0    2513.6     4788     2.25   (/ dense q4_k)
   dense q4_k     1130.3     993.4     2124     1.00
Before (numpy's x W[e]^T per expert, a product per expert for the adapters): moe 13.3x
and moe+lora 11.4x the dense FFN (load 6-20), moe+lora q4_k 3.8x (load 10): OpenBLAS
multiplies an expert's few dozen rows times W^T at about 2 GFLOP/s, oneDNN's float32
matmul (kernels/moe.expert_matmul) at 30-60; the adapters' rank-r products now run
over all rows at once (kernels/moe.py `_lora_*`).

    python bench/moe.py [--threads 2] [--tokens 512] [--repeat 5] [--rank 8] [--json]
"""
from __future__ import annotations

import argparse
import json
import os

import llamatune  # noqa: F401  (threading policy first: before numpy loads OpenBLAS)
import numpy as np

from children import median_fwd_bwd_ms, printed_as_json, rows_per_thread_count

EMBD, N_EXPERT, N_ACTIVE, EXPERT_FFN = 2048, 128, 8, 768     # Qwen3-30B-A3B


def _ops(n_tokens: int, rank: int):
    """{name: (forward, backward)} closures over random inputs of the bench shapes."""
    from llamatune.kernels import moe, swiglu

    rng = np.random.default_rng(0)
    f32 = np.float32
    C, E, k, F = EMBD, N_EXPERT, N_ACTIVE, EXPERT_FFN

    def randn(*shape, scale=1.0):
        return (rng.standard_normal(shape, f32) * f32(scale))

    x, dout = randn(n_tokens, C), randn(n_tokens, C)
    logits, dwr = randn(n_tokens, E), randn(n_tokens, k)
    idx, w, probs = np.zeros((n_tokens, k), np.int64), np.zeros((n_tokens, k), f32), np.zeros((n_tokens, E), f32)
    moe.router_forward(idx, w, probs, logits)
    dlogits = np.zeros_like(logits)
    wg, wu, wd = randn(E, F, C, scale=C ** -0.5), randn(E, F, C, scale=C ** -0.5), randn(E, C, F, scale=F ** -0.5)
    lora = {name: moe.ExpertLora(randn(E, rank, n_in, scale=n_in ** -0.5), randn(E, n_out, rank, scale=0.01), 2.0,
                                 np.zeros((E, rank, n_in), f32), np.zeros((E, n_out, rank), f32))
            for name, n_in, n_out in (("gate", C, F), ("up", C, F), ("down", F, C))}
    out, dx, dw = np.zeros((n_tokens, C), f32), np.zeros((n_tokens, C), f32), np.zeros((n_tokens, k), f32)
    saved = {}

    def moe_fwd(lo):
        saved["rows"] = moe.moe_ffn_forward(out, x, idx, w, wg, wu, wd, lo)

    def moe_bwd(lo):
        moe.moe_ffn_backward(dx, dw, None, None, None, dout, x, w, wg, wu, wd, saved["rows"], lo)

    Fd = k * F
    dg_w, du_w, dd_w = randn(Fd, C, scale=C ** -0.5), randn(Fd, C, scale=C ** -0.5), randn(C, Fd, scale=Fd ** -0.5)
    g, u, h = (np.zeros((n_tokens, Fd), f32) for _ in range(3))
    dh, dg, du = (np.zeros((n_tokens, Fd), f32) for _ in range(3))
    y = np.zeros((n_tokens, C), f32)

    def dense_fwd():
        np.matmul(x, dg_w.T, out=g)
        np.matmul(x, du_w.T, out=u)
        swiglu.swiglu_forward(h, g, u)
        np.matmul(h, dd_w.T, out=y)

    def dense_bwd():
        np.matmul(dout, dd_w, out=dh)
        swiglu.swiglu_backward(dg, du, dh, g, u)
        np.matmul(dg, dg_w, out=dx)
        dx[:] += du @ du_w

    qm = _q4_k_ops(x, dout, idx, w, lora, n_tokens)
    return {
        "moe": (lambda: moe_fwd(None), lambda: moe_bwd(None)),
        "moe+lora": (lambda: moe_fwd(lora), lambda: moe_bwd(lora)),
        "dense": (dense_fwd, dense_bwd),
        "router": (lambda: moe.router_forward(idx, w, probs, logits),
                   lambda: moe.router_backward(dlogits, dwr, idx, w, probs)),
    } | qm


class _Q4Experts:
    """Q4_K expert tensor (E, n_out, n_in) of random blocks (real_size.random_q4_k): w[e]
    dequantized into one scratch, as FrozenBase.expert_matrix hands an expert out."""

    def __init__(self, E, n_out, n_in, seed):
        from real_size import random_q4_k
        self.raw, self.shape = random_q4_k((E * n_out, n_in), seed), (E, n_out, n_in)
        self.out = np.empty((n_out, n_in), np.float32)

    def __getitem__(self, e):
        from gguf import GGMLQuantizationType as QType
        from llamatune.kernels import dequant
        n = self.shape[1]
        dequant.dequantize_into(self.raw[e * n:(e + 1) * n], QType.Q4_K, self.out)
        return self.out


def _q4_k_ops(x, dout, idx, w, lora, n_tokens):
    """moe q4_k, moe+lora q4_k, dense q4_k: the same products with Q4_K weights, each
    matrix (each expert's) dequantized right before its product, as training does."""
    from llamatune.kernels import moe, swiglu
    C, E, k, F = EMBD, N_EXPERT, N_ACTIVE, EXPERT_FFN
    experts = [_Q4Experts(E, F, C, 1), _Q4Experts(E, F, C, 2), _Q4Experts(E, C, F, 3)]
    dense = [_Q4Experts(1, k * F, C, 4), _Q4Experts(1, k * F, C, 5), _Q4Experts(1, C, k * F, 6)]
    out, dx, dw = np.zeros((n_tokens, C), np.float32), np.zeros((n_tokens, C), np.float32), np.zeros_like(w)
    g, u, h, dh, dg, du = (np.zeros((n_tokens, k * F), np.float32) for _ in range(6))
    y = np.zeros((n_tokens, C), np.float32)
    saved = {}

    def moe_fwd(lo):
        saved["rows"] = moe.moe_ffn_forward(out, x, idx, w, *experts, lo)

    def moe_bwd(lo):
        moe.moe_ffn_backward(dx, dw, None, None, None, dout, x, w, *experts, saved["rows"], lo)

    def dense_fwd():
        np.matmul(x, dense[0][0].T, out=g)
        np.matmul(x, dense[1][0].T, out=u)
        swiglu.swiglu_forward(h, g, u)
        np.matmul(h, dense[2][0].T, out=y)

    def dense_bwd():
        np.matmul(dout, dense[2][0], out=dh)
        swiglu.swiglu_backward(dg, du, dh, g, u)
        np.matmul(dg, dense[0][0], out=dx)
        dx[:] += du @ dense[1][0]
    return {"moe q4_k": (lambda: moe_fwd(None), lambda: moe_bwd(None)),
            "moe+lora q4_k": (lambda: moe_fwd(lora), lambda: moe_bwd(lora)),
            "dense q4_k": (dense_fwd, dense_bwd)}


def measure(n_tokens: int, repeat: int, rank: int) -> list[dict]:
    ops = _ops(n_tokens, rank)
    times = median_fwd_bwd_ms(ops, repeat)
    rows = []
    for name in ops:
        r = dict(tokens=n_tokens, op=name)
        r |= times[name]
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank on the experts")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads_child:
        print(json.dumps([dict(threads=args.threads_child, **r)
                          for r in measure(args.tokens, args.repeat, args.rank)]))
        return
    rows = rows_per_thread_count(__file__, args.threads, ["--tokens", str(args.tokens), "--repeat",
                                                          str(args.repeat), "--rank", str(args.rank)])
    if printed_as_json(rows, args.json):
        return
    print(f"embd {EMBD}, {N_EXPERT} experts, {N_ACTIVE} active, expert ffn {EXPERT_FFN}; "
          f"dense ffn {N_ACTIVE * EXPERT_FFN}; LoRA rank {args.rank}; float32")
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"{'threads':>7} {'tokens':>6} {'op':>13} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} {'/ dense':>8}")
    for r in rows:
        ref = "dense q4_k" if r["op"].endswith("q4_k") else "dense"
        dense = next(s for s in rows if s["threads"] == r["threads"] and s["op"] == ref)
        total = r["fwd_ms"] + r["bwd_ms"]
        print(f"{r['threads']:>7} {r['tokens']:>6} {r['op']:>13} {r['fwd_ms']:>8} {r['bwd_ms']:>8} "
              f"{total:>8.1f} {total / (dense['fwd_ms'] + dense['bwd_ms']):>8.2f}")


if __name__ == "__main__":
    main()
