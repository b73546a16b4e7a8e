"""attention (kernels/attention.py, kernels/cuda/attention.py): causal GQA attention
with a KV cache, packed rows (segments), and gemma's options (q.k scale, soft-capped
scores, sliding window). The CPU and CUDA kernels against the numpy reference on
whole tensors over query-block sizes; every backward (numba and reference) against
float64 finite differences; oracles that need no reference (a packed sample equals
the sample alone, a window of 1, keys that slid out, default options give the
default bits, results independent of threads and tiles); the argument checks."""
from functools import partial

import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import (CPU, CUDA, F64, FD_TOL, TOL32, TOL_ATT, cases, impls, qkv, qkv_cache,
                        random_segments, randn, zeros32)

from llamatune.kernels import attention

ATTN_SHAPES = [(2, 5, 4, 2, 8), (1, 7, 4, 1, 6), (2, 3, 2, 2, 4)]  # GQA, MQA, MHA
# packed rows: runs of one to four tokens, ids out of order, padding (-1) at the end
SEGMENTS = np.array([[4, 4, 4, 4, 0, 7, 7, -1], [2, 2, 2, 9, 9, 9, 9, 1]], np.int32)
# runs of 1 to 5 tokens, ids out of order, padding (-1) at the end of row 0
SEGMENTS9 = np.array([[4, 4, 4, 4, 4, 0, 7, 7, -1], [2, 2, 9, 9, 9, 9, 9, 1, 1]], np.int32)


def kernels(b, block, monkeypatch):
    """(forward, backward) of backend b with query blocks of `block` rows (None: the
    kernel's default). CPU: the module's _QBLOCK; CUDA: block_q, 32 threads a block."""
    if b.cuda:
        kw = dict(block_q=block, threads=32)
        return (partial(b.k.attention.attention_forward, **kw),
                partial(b.k.attention.attention_backward, **kw))
    if block is not None:
        monkeypatch.setattr(attention, "_QBLOCK", block)
    return attention.attention_forward, attention.attention_backward


def run(b, fns, q, k, v, n_past=0, segments=None, dout=None, **opts):
    """[out, lse] and, with dout, [dq, dk, dv] of backend b as numpy arrays (outputs
    prefilled with NaN; the backward reads the forward's out and lse). q, dout and
    segments are host arrays; k and v are already on the backend (views as given)."""
    fwd, bwd = fns
    B, T, NH, _ = q.shape
    qd, seg = b.to(q), None if segments is None else b.to(segments)
    res = [b.nan(q.shape, q.dtype), b.nan((B, NH, T), q.dtype)]
    fwd(*res, qd, k, v, n_past, seg, **opts)
    if dout is not None:
        grads = [b.nan(q.shape, q.dtype), b.nan(k.shape, q.dtype), b.nan(v.shape, q.dtype)]
        bwd(*grads, b.to(dout), qd, k, v, *res, seg, **opts)
        res += grads
    return [b.get(a) for a in res]


CPU_FNS = (attention.attention_forward, attention.attention_backward)
REF_FNS = (attention.attention_forward_ref, attention.attention_backward_ref)


def ref(q, k, v, n_past=0, segments=None, dout=None, **opts):
    """run() of the numpy reference (k, v host arrays)."""
    return run(CPU, REF_FNS, q, k, v, n_past, segments, dout, **opts)


def kv_on(b, cache, S, contiguous=False):
    """cache[:, :S] on backend b: a strided view of the whole cache copied there, or a
    C-contiguous copy of the slice."""
    return b.to(cache[:, :S]) if contiguous else b.to(cache)[:, :S]


def assert_all_close(got, want, **tol):
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, **tol)


# ------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("b,shape,n_past,block", cases(
    cpu=[(s, n, qb) for qb in (None, 2) for n in (0, 4) for s in ATTN_SHAPES],  # 2: several query blocks
    cuda=[((1, 5, 2, 1, 4), n, qb) for n in (0, 3) for qb in (None, 2, 3)]))
def test_attention_forward_matches_ref(b, shape, n_past, block, monkeypatch):
    """After n_past cached positions; k, v are strided [:, :S] views of longer caches."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(5)
    q, kc, vc, S = qkv_cache(rng, B, T, NH, NKV, HS, n_past)
    k, v = kv_on(b, kc, S), kv_on(b, vc, S)
    got = run(b, kernels(b, block, monkeypatch), q, k, v, n_past)
    tol = TOL_ATT if b.cuda else TOL32
    assert_all_close(got, ref(q, kc[:, :S], vc[:, :S], n_past), **tol)
    if n_past == 0:  # query 0 sees only key 0: out = v_0 of its kv head
        np.testing.assert_allclose(got[0][:, 0], np.repeat(vc[:, 0], NH // NKV, axis=1), **tol)


@pytest.mark.parametrize("b,shape,block", cases(
    cpu=[(s, qb) for qb in (None, 2) for s in ATTN_SHAPES],
    cuda=[(s, qb) for s in [(1, 5, 2, 1, 4), (1, 4, 4, 2, 3)] for qb in (None, 2, 3)]))  # MQA, GQA
def test_attention_backward_matches_ref(b, shape, block, monkeypatch):
    """The gradients from the same out and lse (the reference's), overwritten (NaN
    prefill). The CUDA backward takes C-contiguous k, v; the CPU one strided views."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(6)
    q, kc, vc, _ = qkv_cache(rng, B, T, NH, NKV, HS)
    dout = randn(rng, B, T, NH, HS)
    out, lse, *want = ref(q, kc[:, :T], vc[:, :T], dout=dout)
    k, v = kv_on(b, kc, T, b.cuda), kv_on(b, vc, T, b.cuda)
    grads = [b.nan(q.shape), b.nan(k.shape), b.nan(v.shape)]
    bwd = kernels(b, block, monkeypatch)[1]
    bwd(*grads, b.to(dout), b.to(q), k, v, b.to(out), b.to(lse))
    assert_all_close([b.get(g) for g in grads], want, **(TOL_ATT if b.cuda else TOL32))


@pytest.mark.parametrize("b,shape,block,segments", cases(
    cpu=[(s, qb, None) for qb in (None, 2, 3)
         for s in [(2, 9, 4, 2, 8), (3, 7, 4, 1, 6), (2, 6, 2, 2, 4)]],
    cuda=[((2, 8, 4, 2, 3), qb, SEGMENTS) for qb in (None, 2, 3)]))
def test_attention_segments_match_ref(b, shape, block, segments, monkeypatch):
    """Packed rows (None: random runs, random_segments), forward and backward against
    the reference; the small blocks put sample starts inside blocks and at block edges."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(7 if b.cuda else 20)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    seg = random_segments(rng, B, T) if segments is None else segments
    dout = randn(rng, B, T, NH, HS)
    got = run(b, kernels(b, block, monkeypatch), q, b.to(k), b.to(v), 0, seg, dout)
    assert_all_close(got, ref(q, k, v, 0, seg, dout), **(TOL_ATT if b.cuda else TOL32))


# scale / softcap / window: each alone, the combinations, windows 1, short, >= T
OPTIONS = [
    dict(scale=0.3), dict(softcap=2.0), dict(window=1), dict(window=3), dict(window=100),
    dict(softcap=1.5, window=4), dict(scale=0.7, softcap=3.0), dict(scale=0.2, window=2),
    dict(scale=0.9, softcap=2.5, window=3),
]
# the CUDA cases: scale / softcap / window alone and together; windows of 1, across blocks
CUDA_OPTIONS = [dict(window=1), dict(window=3, softcap=2.0), dict(scale=0.4, softcap=1.5),
                dict(scale=0.6, softcap=2.5, window=2)]


@pytest.mark.parametrize("b,shape,block,opts", cases(
    cpu=[((2, 7, 4, 2, 8), qb, o) for qb in (None, 2) for o in OPTIONS],
    cuda=[((1, 5, 2, 1, 4), qb, o) for qb in (None, 3) for o in CUDA_OPTIONS]))
def test_attention_options_match_ref(b, shape, block, opts, monkeypatch):
    """gemma's options, forward and backward (n_past = 0) and forward after a cache
    (n_past = 3), whole tensors against the reference; block 2 or 3: windows across
    query blocks."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(6)
    fns = kernels(b, block, monkeypatch)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    q *= 2  # large scores, so that the cap matters
    dout = randn(rng, B, T, NH, HS)
    got = run(b, fns, q, b.to(k), b.to(v), dout=dout, **opts)
    assert_all_close(got, ref(q, k, v, dout=dout, **opts), **TOL_ATT)
    q, kc, vc, S = qkv_cache(rng, B, T, NH, NKV, HS, 3)
    got = run(b, fns, 2 * q, kv_on(b, kc, S), kv_on(b, vc, S), 3, **opts)
    assert_all_close(got, ref(2 * q, kc[:, :S], vc[:, :S], 3, **opts), **TOL_ATT)


@pytest.mark.parametrize("qblock", [128, 3])
@pytest.mark.parametrize("opts", [dict(window=1), dict(window=4), dict(window=30),
                                  dict(scale=0.5, softcap=2.0, window=3)],
                         ids=["window1", "window4", "window30", "all"])
def test_attention_options_with_n_past_match_ref(opts, qblock, monkeypatch):
    """Decoding after a cache: the window counts absolute positions n_past + i."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(7)
    B, T, NH, NKV, HS, n_past = 2, 5, 4, 1, 6, 6
    q, k, v = qkv(rng, B, T, NH, NKV, HS, n_past)  # k, v: [:, :S] slices of a cache
    got = run(CPU, CPU_FNS, q, k, v, n_past, **opts)
    assert_all_close(got, ref(q, k, v, n_past, **opts), **TOL_ATT)


@pytest.mark.parametrize("b,shape,block,opts,segments,seed", cases(
    cpu=[((2, 9, 4, 2, 5), qb, o, SEGMENTS9, 8) for o in [dict(window=2), dict(window=4, softcap=2.0, scale=0.5)]
         for qb in (None, 2, 3)],
    cuda=[((2, 8, 2, 1, 3), 2, dict(scale=0.8, softcap=2.0, window=2), SEGMENTS, 34)]))
def test_attention_options_with_segments_match_ref(b, shape, block, opts, segments, seed, monkeypatch):
    """Packed rows with a window (and soft-capping): the window counts within each
    sample; small blocks put window edges and sample starts inside and across blocks."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(seed)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    got = run(b, kernels(b, block, monkeypatch), q, b.to(k), b.to(v), 0, segments, dout, **opts)
    assert_all_close(got, ref(q, k, v, 0, segments, dout, **opts), **TOL_ATT)


@pytest.mark.parametrize("b,shape,block,together", cases(cpu=[((2, 140, 4, 2, 8), None, False)],  # two query blocks
                                                         cuda=[((1, 4, 2, 1, 4), 2, True)]))
def test_attention_option_defaults_are_the_plain_path(b, shape, block, together, monkeypatch):
    """scale = 1/sqrt(HS) given explicitly, softcap 0 and a window >= every query's
    position (each alone, or all together) give exactly the default results (same
    blocks, same arithmetic): outputs, lse and gradients."""
    B, T, NH, NKV, HS = shape
    rng = np.random.default_rng(10)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    fns, k, v = kernels(b, block, monkeypatch), b.to(k), b.to(v)
    base = run(b, fns, q, k, v, dout=dout)
    variants = ([dict(scale=1 / np.sqrt(HS), softcap=0.0, window=T)] if together else
                [dict(scale=1 / np.sqrt(HS)), dict(softcap=0.0), dict(window=T), dict(window=10 * T)])
    for opts in variants:
        for a, c in zip(base, run(b, fns, q, k, v, dout=dout, **opts), strict=True):
            np.testing.assert_array_equal(a, c)


# ------------------------------------------------------------------ oracles without a reference

@pytest.mark.parametrize("qblock", [128, 3])
def test_attention_packed_row_equals_samples_alone(qblock, monkeypatch):
    """Each sample of a packed row gets exactly what it gets alone in a row of its
    own (no reference involved): outputs, lse and all three gradients."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(21)
    T, NH, NKV, HS = 11, 4, 2, 8
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, 1, T, NH, NKV, HS))
    dout = randn(rng, 1, T, NH, HS)
    seg = np.array([[3, 3, 3, 3, 0, 0, 0, 7, 7, 7, 7]], np.int32)
    res = run(CPU, CPU_FNS, q, k, v, 0, seg, dout)
    for lo, hi in ((0, 4), (4, 7), (7, 11)):
        part = [np.ascontiguousarray(a[:, lo:hi]) for a in (q, k, v, dout)]
        alone = run(CPU, CPU_FNS, *part[:3], 0, None, part[3])
        for got, want in zip(res, alone):
            rows = got[:, :, lo:hi] if got.ndim == 3 else got[:, lo:hi]
            np.testing.assert_allclose(rows, want, **TOL32)


@pytest.mark.parametrize("qblock", [128, 3])
def test_attention_windowed_packed_row_equals_samples_alone(qblock, monkeypatch):
    """With a window, each sample of a packed row gets exactly what it gets alone:
    the window counts positions within the sample (no reference involved)."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(9)
    T, NH, NKV, HS = 11, 4, 2, 4
    opts = dict(window=3, softcap=2.0)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, 1, T, NH, NKV, HS))
    dout = randn(rng, 1, T, NH, HS)
    seg = np.array([[3, 3, 3, 3, 3, 0, 0, 7, 7, 7, 7]], np.int32)
    res = run(CPU, CPU_FNS, q, k, v, 0, seg, dout, **opts)
    for lo, hi in ((0, 5), (5, 7), (7, 11)):
        part = [np.ascontiguousarray(a[:, lo:hi]) for a in (q, k, v, dout)]
        alone = run(CPU, CPU_FNS, *part[:3], 0, None, part[3], **opts)
        for got, want in zip(res, alone):
            rows = got[:, :, lo:hi] if got.ndim == 3 else got[:, lo:hi]
            np.testing.assert_allclose(rows, want, **TOL_ATT)


def test_attention_one_segment_is_the_plain_causal_path():
    rng = np.random.default_rng(22)
    B, T, NH, NKV, HS = 2, 130, 4, 2, 8  # two query blocks
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    results = [run(CPU, CPU_FNS, q, k, v, 0, seg, dout)
               for seg in (None, np.full((B, T), 5, np.int32))]
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("n_past", [0, 3])
def test_attention_window_of_one_sees_only_itself(n_past):
    """window = 1: out_i = v_i (own position), lse_i = the query's own score;
    its gradients: dv_i = sum of the group's dout_i, dq = dk = 0."""
    rng = np.random.default_rng(11)
    B, T, NH, NKV, HS = 2, 6, 4, 2, 4
    q, k, v = qkv(rng, B, T, NH, NKV, HS, n_past)
    out, lse = run(CPU, CPU_FNS, q, k, v, n_past, window=1, softcap=2.0)
    G = NH // NKV
    np.testing.assert_allclose(out, np.repeat(v[:, n_past:], G, axis=2), **TOL_ATT)
    own = np.einsum("bthd,bthd->bht", q, np.repeat(k[:, n_past:], G, axis=2)) / np.sqrt(HS)
    np.testing.assert_allclose(lse, 2.0 * np.tanh(own / 2.0), **TOL_ATT)
    if n_past == 0:
        dout = randn(rng, B, T, NH, HS)
        _, _, dq, dk, dv = run(CPU, CPU_FNS, q, k, v, 0, dout=dout, window=1)
        np.testing.assert_allclose(dq, 0, atol=TOL_ATT["atol"])  # rounding of dP - P dP
        np.testing.assert_allclose(dk, 0, atol=TOL_ATT["atol"])
        np.testing.assert_allclose(dv, dout.reshape(B, T, NKV, G, HS).sum(axis=3), **TOL_ATT)


def test_attention_window_skips_keys_that_slid_out():
    """Keys outside every query's window do not matter: NaN there changes nothing."""
    rng = np.random.default_rng(12)
    B, T, NH, NKV, HS, n_past, window = 1, 4, 2, 1, 4, 6, 3
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, n_past))
    want = run(CPU, CPU_FNS, q, k, v, n_past, window=window)
    first_seen = n_past - window + 1  # query 0 sits at position n_past
    k[:, :first_seen], v[:, :first_seen] = np.nan, np.nan
    got = run(CPU, CPU_FNS, q, k, v, n_past, window=window)
    for a, c in zip(got, want):
        np.testing.assert_array_equal(a, c)


def test_attention_results_do_not_depend_on_threads():
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread only")
    rng = np.random.default_rng(26)
    B, T, NH, NKV, HS = 2, 140, 4, 2, 8
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout, seg = randn(rng, B, T, NH, HS), random_segments(rng, B, T)
    results, before = [], numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            results.append(run(CPU, CPU_FNS, q, k, v, 0, seg, dout))
    finally:
        numba.set_num_threads(before)
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("segmented", [False, True])
def test_attention_results_do_not_depend_on_tiles(segmented, monkeypatch):
    """Tiles of one kv head each, of two, and of all of a batch row's kv heads give the
    same bits: outputs, lse and gradients, plain, soft-capped and windowed."""
    import numba
    monkeypatch.setattr(attention, "_QBLOCK", 4)  # several query blocks
    rng = np.random.default_rng(27)
    B, T, NH, NKV, HS = 3, 11, 6, 3, 5
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    seg = random_segments(rng, B, T) if segmented else None
    pair = (NH // NKV) * 4 * T                                   # score floats of one kv head
    heads = {1: [1] * NKV, 2 * pair: [2, 1], 10 ** 9: [NKV]}      # _TILE_FLOATS: tiles' kv heads
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        for opts in ({}, {"softcap": 2.0}, {"window": 3}):
            results = []
            for floats, want in heads.items():
                monkeypatch.setattr(attention, "_TILE_FLOATS", floats)
                tiles = attention._tiles(B, NKV, pair)
                assert [ks.stop - ks.start for _, ks in tiles] == want * B
                results.append(run(CPU, CPU_FNS, q, k, v, 0, seg, dout, **opts))
            for r in results[1:]:
                for a, c in zip(results[0], r):
                    np.testing.assert_array_equal(a, c)
    finally:
        numba.set_num_threads(before)


def test_attention_tiles_cover_every_pair_once_and_feed_every_thread():
    import numba
    before = numba.get_num_threads()
    try:
        for nw in range(1, min(4, numba.config.NUMBA_NUM_THREADS) + 1):
            numba.set_num_threads(nw)
            for B, NKV, most in [(8, 4, 16), (1, 4, 4), (1, 1, 8), (5, 3, 2), (2, 8, 100), (3, 2, 1)]:
                tiles = attention._tiles(B, NKV, attention._TILE_FLOATS // most)
                pairs = [(b, h) for b, ks in tiles for h in range(NKV)[ks]]
                assert sorted(pairs) == [(b, h) for b in range(B) for h in range(NKV)]
                assert all(ks.stop - ks.start <= most for _, ks in tiles)
                assert len(tiles) >= min(nw, B * NKV)
    finally:
        numba.set_num_threads(before)


@pytest.mark.cuda
def test_cuda_attention_query_block():
    """A quarter of T (at least MIN_BLOCK rows, at most T), within the score budget."""
    kc = CUDA.k
    qb = kc.attention.query_block
    assert qb(4, 32, 512, 512) == 128
    assert qb(1, 8, 100, 100) == 64
    assert qb(1, 8, 40, 40) == 40
    assert qb(1, 32, 4096, 4096) == 256                   # 2^25 / (32 * 4096)
    assert qb(64, 64, 65536, 65536) == 1                  # never 0
    for B, NH, T in [(4, 32, 512), (1, 32, 8192), (8, 8, 256)]:
        assert B * NH * qb(B, NH, T, T) * T <= kc.attention.SCORE_FLOATS


# ------------------------------------------------------------------ finite differences

def fd_attention(fns, B, T, NH, NKV, HS, seed, segments=None, qscale=1, **opts):
    forward, backward = fns
    rng = np.random.default_rng(seed)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, dtype=F64))
    q *= qscale
    dout = randn(rng, B, T, NH, HS, dtype=F64)
    seg = segments(rng, B, T) if callable(segments) else segments
    out, lse = np.zeros_like(q), np.zeros((B, NH, T))

    def loss(q, k, v):
        forward(out, lse, q, k, v, 0, seg, **opts)
        return np.sum(out * dout)

    loss(q, k, v)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward(dq, dk, dv, dout, q, k, v, out.copy(), lse.copy(), seg, **opts)
    err = fd_check(loss, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, **FD_TOL)
    print("fd max rel err", err)


@pytest.mark.parametrize("B,T,NH,NKV,HS", [(2, 4, 4, 2, 3), (1, 5, 2, 1, 4)])
@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_fd(fns, B, T, NH, NKV, HS, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)  # blocks of 3 queries: the block path too
    fd_attention(fns, B, T, NH, NKV, HS, seed=7)


@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_segments_fd(fns, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)
    fd_attention(fns, 2, 7, 4, 2, 3, seed=23, segments=random_segments)


FD_OPTIONS = [dict(window=3), dict(softcap=1.5, scale=0.8), dict(scale=0.6, softcap=2.0, window=2)]


@pytest.mark.parametrize("opts", FD_OPTIONS, ids=["window", "softcap-scale", "all"])
@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_options_fd(fns, opts, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)  # blocks of 3 queries: the block path too
    fd_attention(fns, 1, 7, 4, 2, 3, seed=13, qscale=2, **opts)


@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_options_with_segments_fd(fns, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)
    fd_attention(fns, 2, SEGMENTS9.shape[1], 2, 1, 3, seed=14, segments=SEGMENTS9,
                 scale=0.7, softcap=2.0, window=3)


# ------------------------------------------------------------------ argument checks

def _attn_fwd(q=(1, 2, 2, 4), k=None, n_past=0):
    q = zeros32(*q)
    k = zeros32(1, 2, 2, 4) if k is None else k  # an array: may be a strided view
    lse = zeros32(1, q.shape[-2], 2)
    return lambda: attention.attention_forward(np.zeros_like(q), lse, q, k, zeros32(1, 2, 2, 4), n_past)


def _attn_bwd(dk=(1, 2, 2, 4)):
    X = (1, 2, 2, 4)
    return lambda: attention.attention_backward(zeros32(*X), zeros32(*dk), zeros32(*X), zeros32(*X), zeros32(*X),
                                                zeros32(*X), zeros32(*X), zeros32(*X), zeros32(1, 2, 2))


def _attn_seg(segments, T=2, n_past=0, backward=False):
    X, KV = (1, T, 2, 4), (1, n_past + T, 2, 4)
    if backward:
        return lambda: attention.attention_backward(*[zeros32(*X)] * 8, zeros32(1, 2, T), segments=segments)
    return lambda: attention.attention_forward(zeros32(*X), zeros32(1, 2, T), zeros32(*X), zeros32(*KV),
                                               zeros32(*KV), n_past, segments=segments)


def _attn(backward=False, **opts):
    X = (1, 2, 2, 4)
    if backward:
        return lambda: attention.attention_backward(*[zeros32(*X)] * 8, zeros32(1, 2, 2), **opts)
    return lambda: attention.attention_forward(zeros32(*X), zeros32(1, 2, 2), *[zeros32(*X)] * 3, 0, **opts)


def _cuda(q=(1, 2, 3, 4), k=(1, 2, 2, 4), n_past=0, seg=None, backward=False, **opts):
    """A CUDA attention call on zero inputs of these shapes."""
    def call():
        kc, dev, nan = CUDA.k, CUDA.to, CUDA.nan
        B, T, NH, _ = q
        qd, kd = dev(zeros32(*q)), dev(zeros32(*k))
        s = None if seg is None else dev(seg)
        if backward:
            kc.attention.attention_backward(qd, kd, kd, qd, qd, kd, kd, qd, nan((B, NH, T)), s, **opts)
        else:
            kc.attention.attention_forward(nan(q), nan((B, NH, T)), qd, kd, kd, n_past, s, **opts)
    return call


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (_attn_fwd(n_past=-1), "n_past must be >= 0"),
    (_attn_fwd(q=(2, 2, 4)), "q must be a 4-D"),
    (_attn_fwd(k=zeros32(2, 2, 4)), "k must be a 4-D"),
    (_attn_fwd(q=(1, 2, 3, 4)), "query heads 3 must be a multiple of kv heads 2"),
    (_attn_fwd(k=zeros32(1, 3, 2, 4)),
     r"k must be a contiguous per batch element float32 array of shape \(1, 2, 2, 4\)"),
    (_attn_fwd(k=zeros32(1, 2, 2, 8)[..., ::2]), "k must be a contiguous per batch element"),
    (_attn_bwd(dk=(1, 2, 1, 4)), "dk must be a C-contiguous"),
    (_attn_seg(np.zeros((1, 2), np.int64)), r"segments must be an int32 array of shape \(1, 2\)"),
    (_attn_seg(np.zeros((2, 1), np.int32)), r"segments must be an int32 array of shape \(1, 2\)"),
    (_attn_seg(np.array([[1, 2, 1]], np.int32), T=3), "segments row 0: sample id 1 appears in two"),
    (_attn_seg(np.zeros((1, 2), np.int32), n_past=1), "segments need n_past = 0"),
    (_attn_seg(np.array([[1, 2, 1]], np.int32), T=3, backward=True), "appears in two separate runs"),
    (_attn(scale=0.0), "attention: scale must be None or a finite number > 0, got 0.0"),
    (_attn(scale=float("nan"), backward=True), "scale must be None or a finite number > 0"),
    (_attn(softcap=-1.0), "attention: softcap must be a finite number >= 0, got -1.0"),
    (_attn(window=-1), r"attention: window must be an integer >= 0 \(0: no window\), got -1"),
    (_attn(window=2.5, backward=True), "window must be an integer >= 0"),
], cuda=[
    (_cuda(), "multiple of kv heads"),
    (_cuda(n_past=-1), "n_past"),
    (_cuda(q=(1, 2, 2, 4), seg=np.zeros((1, 2), np.int64)),
     r"segments must be a C-contiguous int32 device array of shape \(1, 2\)"),
    (_cuda(q=(1, 1, 2, 4), n_past=1, seg=np.zeros((1, 1), np.int32)), "segments need n_past = 0"),
    (_cuda(q=(1, 2, 2, 4), k=(1, 2, 1, 4), scale=-1.0),
     "attention: scale must be None or a finite number > 0"),
    (_cuda(q=(1, 2, 2, 4), k=(1, 2, 1, 4), softcap=float("inf")),
     "attention: softcap must be a finite number >= 0"),
    (_cuda(q=(1, 2, 2, 4), k=(1, 2, 1, 4), window=-2, backward=True),
     r"attention: window must be an integer >= 0"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
