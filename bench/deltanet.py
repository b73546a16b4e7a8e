"""Benchmark: forward + backward of a gated delta-net layer's mixing ops against causal
attention of the same width (CPU kernels), and their working memory, over ctx.

Shapes are Qwen3.5-4B's (config.json): the delta-net layers have 16 q/k heads and
32 value heads of 128 (linear_num_key_heads, linear_num_value_heads,
linear_key_head_dim, linear_value_head_dim), a conv of kernel 4 over q, k and v
(2 * 16 * 128 + 32 * 128 = 8192 channels) and the gated norm over the 32 * 128
outputs; the gated full-attention layers have 16 query heads and 4 kv heads of 256:
both are 4096 wide. One batch row (B = 1) of T = ctx tokens.

Timed, each the median of --repeat rounds after a warm-up (compilation excluded):
* deltanet: kernels/deltanet.py's chunked forward and backward (no initial state);
* conv+norm: kernels/causal_conv.py and kernels/gated_norm.py, forward and backward;
* attention: kernels/attention.py's forward and backward (float32).
The ops run in alternation within each round (deltanet, conv+norm, attention, then
the next round), so a change in the machine's load (the cores may be shared) falls on
all of them alike. `ratio` is (deltanet + conv+norm) / attention.

Memory: the peak of numpy's allocations (tracemalloc) during the forward and during
the backward, beyond the inputs, outputs and gradients, which the caller owns
(attention's forward also keeps its lse; the delta rule keeps nothing between the
passes). Scratch that numba kernels allocate (the conv's and norm's dw partials) is
not seen. Attention's working memory is bounded by its score tiles (a block of 128
queries against all keys, at most 4 MB a worker), linear in ctx; the delta rule's is
its items' padded head copies, per-chunk matrices and chunk states, linear in ctx
up to 2048 (an item runs in groups of 32 chunks) and larger than attention's at
these lengths. Each thread count runs in a fresh process.

Measured on 2 cores of an Intel Xeon with AVX-512 shared with other jobs (load average
8-17 on the 2 cores), so only the alternated ratios mean something; two runs of
`--threads 2 --repeat 3`, the second after the groups of 32 chunks:
      T   deltanet fwd+bwd ms   conv+norm   attention   ratio   MB fwd/bwd: deltanet  attention
    512        1153.9 /  741.6   116 /  85   403 / 241  3.15 / 3.43        20 / 33     4 / 16
   1024        2161.2 / 1020.1   316 / 118  1320 / 631  1.88 / 1.80        39 / 62     8 / 26
   2048        4812.3 / 3186.1   484 / 352  4457 / 2587 1.19 / 1.37        77 / 126    8 / 23

    python bench/deltanet.py [--threads 2] [--T 512,1024,2048] [--repeat 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import tracemalloc

from children import median_fwd_bwd_ms, printed_as_json, rows_per_thread_count

NK, NV, DK, DV, KCONV = 16, 32, 128, 128, 4  # Qwen3.5-4B's delta-net layers
NH, NKV, HS = 16, 4, 256  # its gated full-attention layers


def _ops(T: int):
    """{name: (forward, backward)} closures over random inputs of the bench shapes."""
    import llamatune  # noqa: F401  (threading policy first: before numpy loads OpenBLAS)
    import numpy as np
    from llamatune.kernels import attention, causal_conv, deltanet, gated_norm

    rng = np.random.default_rng(0)
    f32 = np.float32

    def randn(*shape):
        return rng.standard_normal(shape, f32)

    q, k, v = randn(1, T, NK, DK), randn(1, T, NK, DK), randn(1, T, NV, DV)
    g = -np.log1p(np.exp(randn(1, T, NV))).astype(f32)  # the models' g = -A softplus(.)
    beta = (1 / (1 + np.exp(-randn(1, T, NV)))).astype(f32)
    out, dout = np.zeros_like(v), randn(*v.shape)
    grads = [np.zeros_like(a) for a in (q, k, v, g, beta)]
    C = 2 * NK * DK + NV * DV
    x, w = randn(1, T, C), 0.5 * randn(C, KCONV)
    xo, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros_like(w)
    z, nw = randn(T * NV, DV), np.ones(DV, f32)
    no, rstd, dn, dz, dnw = np.zeros_like(z), np.zeros(T * NV, f32), np.zeros_like(z), np.zeros_like(z), nw * 0
    o2 = out.reshape(T * NV, DV)
    qa, ka, va = randn(1, T, NH, HS), randn(1, T, NKV, HS), randn(1, T, NKV, HS)
    oa, lse, doa = np.zeros_like(qa), np.zeros((1, NH, T), f32), randn(1, T, NH, HS)
    dqa, dka, dva = np.zeros_like(qa), np.zeros_like(ka), np.zeros_like(va)

    def conv_norm_fwd():
        causal_conv.causal_conv_forward(xo, x, w)
        gated_norm.gated_rmsnorm_forward(no, rstd, o2, z, nw, 1e-6)

    def conv_norm_bwd():
        gated_norm.gated_rmsnorm_backward(dn, dz, dnw, no, o2, z, nw, rstd)
        causal_conv.causal_conv_backward(dx, dw, xo, x, w)

    return {
        "deltanet": (lambda: deltanet.deltanet_forward(out, None, q, k, v, g, beta),
                     lambda: deltanet.deltanet_backward(*grads, None, dout, q, k, v, g, beta)),
        "conv+norm": (conv_norm_fwd, conv_norm_bwd),
        "attention": (lambda: attention.attention_forward(oa, lse, qa, ka, va, 0),
                      lambda: attention.attention_backward(dqa, dka, dva, doa, qa, ka, va, oa, lse)),
    }


def _peak_mb(fn) -> float:
    """MB of numpy allocations at fn's peak, beyond what was allocated before it."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return round((peak - base) / 2**20, 1)


def measure(T: int, repeat: int) -> list[dict]:
    ops = _ops(T)
    times = median_fwd_bwd_ms(ops, repeat)
    rows = []
    for name, (fwd, bwd) in ops.items():
        r = dict(T=T, op=name)
        r |= times[name]
        r["fwd_peak_mb"], r["bwd_peak_mb"] = _peak_mb(fwd), _peak_mb(bwd)
        rows.append(r)
    return rows


def child(args) -> None:
    rows = []
    for T in args.T:
        for r in measure(T, args.repeat):
            rows.append(dict(threads=args.threads_child, **r))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--T", default="512,1024,2048", help="comma-separated context lengths")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.T = [int(t) for t in args.T.split(",")]
    if args.threads_child:
        child(args)
        return
    rows = rows_per_thread_count(__file__, args.threads, ["--T", ",".join(map(str, args.T)),
                                                          "--repeat", str(args.repeat)])
    if printed_as_json(rows, args.json):
        return
    print(f"delta-net NK={NK} NV={NV} DK={DK} DV={DV} conv {KCONV}; attention NH={NH} NKV={NKV} "
          f"HS={HS}; B=1")
    print(f"{'threads':>7} {'T':>5} {'op':>10} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} "
          f"{'fwd MB':>7} {'bwd MB':>7}")
    for r in rows:
        print(f"{r['threads']:>7} {r['T']:>5} {r['op']:>10} {r['fwd_ms']:>8} {r['bwd_ms']:>8} "
              f"{r['fwd_ms'] + r['bwd_ms']:>8.1f} {r['fwd_peak_mb']:>7} {r['bwd_peak_mb']:>7}")
        if r["op"] == "attention":
            mine = [s for s in rows if s["threads"] == r["threads"] and s["T"] == r["T"]
                    and s["op"] != "attention"]
            layer = sum(s["fwd_ms"] + s["bwd_ms"] for s in mine)
            print(f"{'':>7} {'':>5} {'ratio':>10} {layer / (r['fwd_ms'] + r['bwd_ms']):>8.2f}"
                  "  (deltanet + conv+norm) / attention")


if __name__ == "__main__":
    main()
