"""attention with bf16 products (kernels/attention_bf16.py) and the batched product it
runs on (kernels/bf16.batched).

Whole tensors against two float64 references: the exact attention (the bf16 errors,
a few 1e-3 of the outputs' scale, and nothing more: a wrong mask, head or block
gives errors of order 1), and the same attention with the kernel's roundings applied
(v, dout, P and dS rounded to bf16 where the kernel rounds them, q and k in the
gradients' products but not in the scores, which stay float32), which it must
match to float32 accumulation but for rare ties of P's rounding. Then the oracles that
need no reference: results independent of threads and tiles, the float32 path taken
bit for bit where the module hands over (float64, soft-capping, decode steps)."""
import numpy as np
import pytest
from op_helpers import qkv, random_segments, randn

from llamatune.kernels import attention, attention_bf16, bf16

pytestmark = pytest.mark.skipif(not bf16.available(),
                                reason="needs oneDNN (pip install 'llamatune[cpu-bf16]')")


def rounded(x):
    """float64 of x rounded to bf16 (to nearest even), as the kernel rounds."""
    return bf16.from_bf16_ref(bf16.to_bf16_ref(np.asarray(x, np.float32))).astype(np.float64)


def reference(q, k, v, n_past=0, segments=None, dout=None, window=0, emulate=False):
    """[out, lse(, dq, dk, dv)] in float64 per head: the exact attention, or with
    `emulate` the kernel's roundings (bf16 v, dout, P, dS, and q, k in dq and dk's
    products; the scores, lse, rowsum(dout * out) and the softmax exact)."""
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    r = rounded if emulate else (lambda x: np.asarray(x, np.float64))
    q64, k64, v64 = r(q), r(k), r(v)
    qs, ks = np.asarray(q, np.float64), np.asarray(k, np.float64)  # the scores' inputs
    out, lse = np.zeros(q.shape), np.zeros((B, NH, T))
    grads = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)] if dout is not None else []
    scale = 1 / np.sqrt(HS)
    for b in range(B):
        for h in range(NH):
            kh = h // G
            P, lse[b, h], _ = attention._probs_ref(qs, ks, b, h, kh, n_past, segments, window=window)
            out[b, :, h] = r(P) @ v64[b, :, kh]
            if dout is None:
                continue
            do = r(dout[b, :, h])
            d = np.sum(np.float64(dout[b, :, h]) * out[b, :, h], axis=1, keepdims=True)
            dS = r(P * (do @ v64[b, :, kh].T - d) * scale)
            grads[0][b, :, h] = dS @ k64[b, :, kh]
            grads[1][b, :, kh] += dS.T @ q64[b, :, h]
            grads[2][b, :, kh] += r(P).T @ do
    return [out, lse, *grads]


def run(q, k, v, n_past=0, segments=None, dout=None, module=attention_bf16, **opts):
    """[out, lse(, dq, dk, dv)] of `module` (outputs prefilled with NaN; the backward
    reads the forward's out and lse)."""
    B, T, NH, _ = q.shape
    res = [np.full(q.shape, np.nan, q.dtype), np.full((B, NH, T), np.nan, q.dtype)]
    module.attention_forward(*res, q, k, v, n_past, segments, **opts)
    if dout is not None:
        grads = [np.full(a.shape, np.nan, q.dtype) for a in (q, k, v)]
        module.attention_backward(*grads, dout, q, k, v, *res, segments, **opts)
        res += grads
    return res


def assert_bf16_close(got, exact, emulated):
    """Each tensor within bf16's error of the exact attention (2e-2 of its largest
    element; measured 1e-3 to 6.3e-3) and within 1e-4 of the emulated one (measured
    2e-8 to 1e-7, up to 2.4e-5 where a P or dS element near a tie rounds the other
    way), whole tensors."""
    for name, g, e, m in zip(("out", "lse", "dq", "dk", "dv"), got, exact, emulated):
        scale = np.abs(e).max()
        assert np.isfinite(g).all(), name
        assert np.abs(g - e).max() <= 2e-2 * scale, (name, np.abs(g - e).max() / scale)
        assert np.abs(g - m).max() <= 1e-4 * scale, (name, np.abs(g - m).max() / scale)


CASES = [  # (B, T, NH, NKV, HS), n_past, packed, window
    ((2, 40, 4, 2, 16), 0, False, 0),     # GQA, three query blocks of 16
    ((1, 37, 4, 1, 8), 0, True, 0),       # MQA, packed samples, a ragged last block
    ((2, 33, 2, 2, 16), 0, False, 9),     # MHA, a sliding window
    ((2, 40, 8, 2, 16), 0, True, 7),      # G = 4, packed and windowed
]


@pytest.fixture
def small_blocks(monkeypatch):
    """Query blocks of 16 rows and keys aligned to 8: several blocks, shifted starts."""
    monkeypatch.setattr(attention, "_QBLOCK", 16)
    monkeypatch.setattr(attention_bf16, "KEY_ALIGN", 8)


@pytest.mark.parametrize("shape,n_past,packed,window", CASES)
def test_bf16_attention_forward_and_backward_match_the_references(shape, n_past, packed, window, small_blocks):
    rng = np.random.default_rng(40)
    B, T, NH, NKV, HS = shape
    q, k, v = qkv(rng, B, T, NH, NKV, HS)
    dout = randn(rng, B, T, NH, HS)
    seg = random_segments(rng, B, T) if packed else None
    got = run(q, k, v, 0, seg, dout, window=window)
    assert_bf16_close(got, reference(q, k, v, 0, seg, dout, window),
                      reference(q, k, v, 0, seg, dout, window, emulate=True))


def test_bf16_attention_scores_stay_float32_when_they_are_large(small_blocks):
    """q and k of a large norm (scores of order 100, as Qwen2's biased q and k give):
    scores from bf16 q and k would be off by about 2^-8 |q| |k|, which the softmax
    exponentiates (out 9.5 % of its scale off, lse 2.8e-3, dq 16 %); the kernel's float32
    scores keep out within 0.3 % and lse within 2e-7 (measured). dq and dk, products of
    bf16 dS and bf16 k or q whose terms here cancel, stay within 2.3 %."""
    rng = np.random.default_rng(48)
    B, T, NH, NKV, HS = 2, 40, 4, 2, 16
    q, k, v = qkv(rng, B, T, NH, NKV, HS)
    q, k = q * 12, k * 12  # |q.k| / sqrt(HS) up to a few hundred
    dout = randn(rng, B, T, NH, HS)
    got = run(q, k, v, 0, None, dout)
    exact = reference(q, k, v, 0, None, dout)
    rounded_scores = reference(rounded(q).astype(np.float32), rounded(k).astype(np.float32), v, 0, None, dout)
    error = lambda x, e: np.abs(x - e).max() / np.abs(e).max()
    for name, g, e, bound in zip(("out", "lse", "dq", "dk", "dv"), got, exact, (1e-2, 1e-5, 4e-2, 4e-2, 1e-2)):
        assert np.isfinite(g).all() and error(g, e) <= bound, (name, error(g, e))
    assert error(rounded_scores[0], exact[0]) > 5e-2 and error(rounded_scores[1], exact[1]) > 1e-3


@pytest.mark.parametrize("n_past,window", [(5, 0), (21, 0), (21, 6)])
def test_bf16_attention_forward_after_a_cache(n_past, window, small_blocks):
    """T new queries after n_past cached keys, k and v strided [:, :S] views of a cache."""
    rng = np.random.default_rng(41)
    q, k, v = qkv(rng, 2, 20, 4, 2, 16, n_past)
    got = run(q, k, v, n_past, window=window)
    assert_bf16_close(got, reference(q, k, v, n_past, window=window),
                      reference(q, k, v, n_past, window=window, emulate=True))


def test_bf16_attention_results_do_not_depend_on_threads_or_tiles(small_blocks, monkeypatch):
    import numba
    rng = np.random.default_rng(42)
    B, T, NH, NKV, HS = 3, 40, 6, 3, 16
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout, seg = randn(rng, B, T, NH, HS), random_segments(rng, B, T)
    pair = (NH // NKV) * 16 * T
    results, before = [], numba.get_num_threads()
    try:
        for threads, floats in ((1, 10 ** 9), (1, pair), (min(2, numba.config.NUMBA_NUM_THREADS), 2 * pair)):
            numba.set_num_threads(threads)
            monkeypatch.setattr(attention, "_TILE_FLOATS", floats)
            results.append(run(q, k, v, 0, seg, dout))
    finally:
        numba.set_num_threads(before)
    for r in results[1:]:
        for a, c in zip(results[0], r):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("what", ["float64", "softcap", "decode"])
def test_bf16_attention_hands_over_to_the_float32_kernels(what):
    """float64 (the finite-difference checks), soft-capped scores and fewer than
    MIN_ROWS queries run the float32 kernels: the same bits."""
    rng = np.random.default_rng(43)
    T = attention_bf16.MIN_ROWS - 1 if what == "decode" else 24
    dtype = np.float64 if what == "float64" else np.float32
    q, k, v = qkv(rng, 2, T, 4, 2, 8, dtype=dtype)
    dout = randn(rng, 2, T, 4, 8, dtype=dtype)
    opts = {"softcap": 3.0} if what == "softcap" else {}
    for a, c in zip(run(q, k, v, 0, None, dout, **opts),
                    run(q, k, v, 0, None, dout, module=attention, **opts)):
        np.testing.assert_array_equal(a, c)


# ------------------------------------------------------------------ batched products

def test_batched_matches_numpy_on_strided_and_transposed_views():
    """out[i] = a[i] @ b[i] and out[i] += ..., operands given as views (a transposed
    operand, a slice of a longer batch, rows apart): float32 sums of exact bf16 terms."""
    rng = np.random.default_rng(44)
    a = bf16.to_bf16_ref(randn(rng, 3, 24, 40))
    b_long = bf16.to_bf16_ref(randn(rng, 3, 50, 24))
    f = lambda x: bf16.from_bf16_ref(x).astype(np.float64)
    for aa, bb in ((a[:, :, :24], b_long[:, 10:34, :]),           # a row slice, keys from a longer batch
                   (a.transpose(0, 2, 1), b_long[:, :24, :]),     # a transposed: (3, 40, 24)
                   (a[:, :, :24], b_long[:, :24, :16])):                 # b's rows apart (24 > 16)
        out = np.full((3, aa.shape[1], bb.shape[2]), np.nan, np.float32)
        bf16.batched(out, aa, bb)
        want = f(aa) @ f(bb)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())
        before = out.copy()
        bf16.batched(out, aa, bb, accumulate=True)
        np.testing.assert_allclose(out, before + want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_batched_runs_at_once_on_threads_of_a_pool():
    """Threads that multiply at the same moment, each with products of several shapes
    (their own stream, primitives and scratchpad), get the single-thread results."""
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(45)
    pairs = [(bf16.to_bf16_ref(randn(rng, 2, m, 32)), bf16.to_bf16_ref(randn(rng, 2, 32, n)))
             for m, n in ((64, 48), (32, 96), (128, 16))]

    def work(seed):
        outs = []
        for _ in range(20):
            for a, b in pairs:
                out = np.empty((2, a.shape[1], b.shape[2]), np.float32)
                bf16.batched(out, a, b)
                outs.append(out)
        return outs

    alone = work(0)
    with ThreadPoolExecutor(4) as pool:
        for outs in pool.map(work, range(4)):
            for x, y in zip(outs, alone):
                np.testing.assert_array_equal(x, y)


def test_batched_float32_operands_match_numpy():
    """float32 a and b (attention's scores) run oneDNN's float32 kernels: within float32
    sums of the float64 product, on a transposed view, with accumulation."""
    rng = np.random.default_rng(47)
    a, b = randn(rng, 3, 24, 40), randn(rng, 3, 33, 40)
    out = np.full((3, 24, 33), np.nan, np.float32)
    bf16.batched(out, a, b.transpose(0, 2, 1))
    want = a.astype(np.float64) @ b.astype(np.float64).transpose(0, 2, 1)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * np.abs(want).max())
    bf16.batched(out, a, b.transpose(0, 2, 1), accumulate=True)
    np.testing.assert_allclose(out, 2 * want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_batched_rejects_bad_arguments():
    a = np.zeros((2, 4, 8), np.uint16)
    with pytest.raises(ValueError, match="a must be a 3-D uint16"):
        bf16.batched(np.zeros((2, 4, 4), np.float32), a.astype(np.int32), a.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="b must be a 3-D float32.*both uint16 or both float32"):
        bf16.batched(np.zeros((2, 4, 4), np.float32), a.astype(np.float32), a.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="do not match"):
        bf16.batched(np.zeros((2, 4, 4), np.float32), a, a)
    with pytest.raises(ValueError, match="out must be a 3-D float32"):
        bf16.batched(np.zeros((2, 4, 4), np.uint16), a, a.transpose(0, 2, 1))


def test_batched_keeps_a_bounded_number_of_primitives(monkeypatch):
    """A thread keeps the BATCHED_KEPT most recent primitives (a chat's prompts bring new
    widths); one dropped is built again when its shape returns, with the same result."""
    monkeypatch.setattr(bf16, "BATCHED_KEPT", 2)
    rng = np.random.default_rng(46)
    a = bf16.to_bf16_ref(randn(rng, 1, 8, 16))
    first = None
    for n in (8, 16, 24, 8):
        b = bf16.to_bf16_ref(randn(np.random.default_rng(n), 1, 16, n))
        out = np.empty((1, 8, n), np.float32)
        bf16.batched(out, a, b)
        first = out.copy() if first is None else first
        assert len(bf16._SERIAL.primitives) <= 2
    np.testing.assert_array_equal(out, first)
