"""Causal grouped-query softmax attention, forward and backward (BLAS + numba + numpy refs).

    out_i = sum_j P_ij v_j,   P_ij = softmax_j(s_ij),   s_ij = q_i . k_j * scale

over keys j <= n_past + i (query i sits at absolute position n_past + i). Query head
h reads kv head h // (NH // NKV), ggml's broadcast rule for GQA. This is what
llama.cpp builds in `llm_graph_context::build_attn_mha` (llama-graph.cpp) from
ggml_mul_mat(k, q), `ggml_soft_max_ext` with the causal KQ mask and scale
(ggml-cpu ops.cpp `ggml_compute_forward_soft_max_f32`) and ggml_mul_mat(v, kq).

Options of the newer architectures (keyword arguments; their defaults give the
plain path above bit for bit):
* scale: the q.k multiplier; None is 1/sqrt(HS) (gemma3 passes its own).
* softcap > 0 (gemma2): scores are soft-capped before the mask and the softmax,
  s_ij = softcap * tanh(q_i . k_j * scale / softcap), as ggml_flash_attn_ext does
  (ops.cpp: `scale /= logit_softcap`, then `s = logit_softcap*tanhf(s*scale)`; the
  unfused graph of build_attn_mha computes the same with q pre-scaled). The
  backward multiplies dS by ds/d(q.k) = scale * (1 - tanh^2).
* window > 0: sliding-window causal mask, llama.cpp's LLAMA_SWA_TYPE_STANDARD
  (`llama_hparams::is_masked_swa`: masked when p1 - p0 >= n_swa): query i also
  needs n_past + i - j < window, so it sees at most the last `window` keys, itself
  included. With packed segments the window counts within the sample (positions
  restart at each sample, and a sample's tokens are adjacent).

Packed rows (training, n_past = 0): an optional `segments` (B, T) int32 gives the
sample id of each token of a row holding several samples; query i then sees key j
only when j <= i and segments[b, j] == segments[b, i] (llama.cpp's KQ mask for a
batch of several sequences, `llama_kv_cache::set_input_kq_mask`). Each row's ids
must form contiguous runs (a sample's tokens are adjacent; `segment_starts` checks
it), so query i sees exactly the keys [start_i, i], start_i the first token of its
sample. A token always sees itself, so no softmax row is ever empty (no 0/0, no
-inf lse). segments=None is the plain causal mask (start_i = 0).

Layout of the computation. The work is split into tiles, each a batch row and a
run of its kv heads (`_tiles`): the G = NH // NKV query heads of a kv head share
its K and V, so K and V are never repeated and the tiles write disjoint parts of
every output. Within a tile:
* queries go in blocks of _QBLOCK rows; block [i0, i1) only meets keys
  [lo_i0, n_past + i1), lo_i0 the first key its first row sees, which skips most
  of the masked upper triangle (and, for packed rows, the keys of earlier samples;
  with a window, the keys that slid out of it) and bounds the score buffer to
  (nk, G, _QBLOCK, S), allocated once per worker and call;
* the T x S products are numpy's batched `np.matmul` calls over (nk, G, TQ, HS)
  views, K and V broadcast over each kv head's query heads (no copies, except the
  q/dout blocks of the dk/dv products);
* the masked softmax (and its backward) is a numba kernel over rows that only
  touches each row's visible keys [lo, hi) and writes 0 elsewhere. The
  exponential is vecmath.py's branch-free float32 polynomial (<= 3 ulp from libm's
  expf; float64 keeps np.exp) and the row max an 8-way unrolled loop, both
  vectorized by LLVM (numba has no SVML here; with libm's expf the kernel took 2.6
  ns per score instead of 0.45); the forward normalizes P in the same kernel, on
  each row while it is in L1, as ggml's soft_max does before its P.v product
  (scaling the strided (TQ, HS) output rows with numpy after the product took 18 us
  a block, more than the kernel's extra pass); its sums are in the scores' type, as
  a float64 accumulator would halve the vector width;
* soft-capping is a separate pass (`_softcap_scores_kernel`) that turns the raw
  scores into s (and, for the backward, ds/d(q.k) into a third score buffer);
  the softmax kernels then run on s with scale 1, and the backward multiplies
  their dS by ds/d(q.k); its tanh is vecmath's vectorized float32 one (within 1.2
  ulp of tanhf). The default path calls the softmax kernels exactly as
  before the options existed (same signature, no extra argument to dispatch).
Threading: the tiles are dealt to numba.get_num_threads() threads of one pool,
each running single-threaded BLAS (threadpoolctl) and serial kernels, so one call
has one fork-join. Before, every one of the many small matmuls ran multi-threaded
OpenBLAS and every softmax a numba prange: under CPU contention each of those
joins waited for a descheduled thread, and the attention of the bench shape
(B=8, T=256, NH=8, NKV=4, HS=64, 2 threads, load average ~30 on 2 cores) ran at
0.2 GFLOP/s forward, 0.3 backward, against 11 and 9 then (bench/attention.py).
Results do not depend on the thread count or the tiles.

With a bf16 compute dtype, kernels/attention_bf16.py runs these same blocks and tiles
with the T x S products but the scores in bf16 (oneDNN) and this module's float32
softmax logic.

The backward is flash-attention style: it recomputes P = exp(s - lse) from the
saved log-sum-exp, so no (T, T) probabilities are kept between the passes:
    dP = dout v^T;  dS = P * (dP - rowsum(dout * out)) * ds/d(q.k)
    dq = dS k;  dk = dS^T q;  dv = P^T dout      (dk, dv summed over each group)
with ds/d(q.k) = scale, or scale * (1 - (s/softcap)^2) when soft-capped.
All gradients are overwritten.
"""

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit

from .cpuinfo import blas_one_thread
from .vecmath import FASTMATH as _FASTMATH
from .vecmath import expf as _exp
from .vecmath import row_max as _row_max
from .vecmath import tanhf as _tanh

_QBLOCK = 128  # query rows per block; at T=256 fwd 21 / bwd 48 ms vs 27 / 57 ms for 256
_TILE_FLOATS = 1 << 20  # scores of a tile's query block, at most (4 MB float32; see _tiles)


@njit(inline="always")
def _zero_outside(row, a, n):
    """row[:a] = row[n:] = 0: a score row's keys that a query does not see (a, n uint64)."""
    for j in range(a):
        row[j] = 0
    for j in range(n, np.uint64(row.shape[0])):
        row[j] = 0


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _softmax_causal_kernel(att, lse, scale, lo, hi):
    # att (R, TQ, S): raw scores q.k in, R = nk * G score rows of one block of a tile
    # (kv heads, query heads of each); out P = exp(s*scale - lse), 0 outside
    # [lo[i], hi[i]); lse (nk, G, TQ) out (a view into the (B, NH, T) lse)
    R, TQ = att.shape[:2]
    G = lse.shape[1]
    for r in range(R * TQ):
        h = r // TQ
        i = r % TQ
        row = att[h, i]
        a, n = np.uint64(lo[i]), np.uint64(hi[i])  # unsigned: see _row_max
        mx = _row_max(row, a, n) * scale  # scale > 0: the max of the scaled scores
        tot = scale - scale  # zero of the array's type (scale * 0 would be float64: float32 * int64)
        for j in range(a, n):
            e = _exp(row[j] * scale - mx)
            row[j] = e
            tot += e
        _zero_outside(row, a, n)
        inv = 1 / tot
        for j in range(a, n):  # normalized as ggml's soft_max, on the row while in L1
            row[j] *= inv
        lse[h // G, h % G, i] = mx + np.log(tot)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _softmax_causal_backward_kernel(att, dp, lse, out, dout, scale, lo, hi):
    # att (R, TQ, S): raw scores q.k in, P out; dp (R, TQ, S): dout.v in, dS*scale out
    # (R = nk * G rows as in the forward); lse (nk, G, TQ); out, dout (TQ, nk, G, HS):
    # this block's rows; visible keys [lo[i], hi[i])
    R, TQ = att.shape[:2]
    G, HS = out.shape[2], out.shape[3]
    for r in range(R * TQ):
        h = r // TQ
        i = r % TQ
        kh, g = h // G, h % G
        a, n = np.uint64(lo[i]), np.uint64(hi[i])
        d = scale - scale  # rowsum(dout * out) = rowsum(P * dP), in the array's type
        for c in range(HS):
            d += dout[i, kh, g, c] * out[i, kh, g, c]
        lse_i = lse[kh, g, i]
        row, drow = att[h, i], dp[h, i]
        for j in range(a, n):
            p = _exp(row[j] * scale - lse_i)
            row[j] = p
            drow[j] = p * (drow[j] - d) * scale
        _zero_outside(row, a, n)
        _zero_outside(drow, a, n)


@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")  # vecmath.tanhf: see there
def _softcap_scores_kernel(att, deriv, cap, kcap, scale, lo, hi):
    # att (R, TQ, S): raw scores q.k in; out s = cap*tanh(q.k*kcap) (kcap = scale/cap) on
    # each row's visible keys [lo[i], hi[i]), the rest untouched (the softmax kernels
    # never read it); deriv: None, or (R, TQ, S) out: ds/d(q.k) = scale*(1 - tanh^2)
    # there and 0 elsewhere. The softmax kernels then run on s with scale 1.
    R, TQ, S = att.shape
    for r in range(R * TQ):
        h = r // TQ
        i = r % TQ
        row = att[h, i]
        a, n = np.uint64(lo[i]), np.uint64(hi[i])
        for j in range(a, n):
            t = _tanh(row[j] * kcap)
            row[j] = cap * t
            if deriv is not None:
                deriv[h, i, j] = scale - scale * t * t
        if deriv is not None:
            for j in range(a):
                deriv[h, i, j] = 0.0
            for j in range(n, np.uint64(S)):
                deriv[h, i, j] = 0.0


def _check(name, a, shape, dtype, rows_only=False):
    # rows_only: k, v may be [:, :S] slices of a cache, contiguous per batch element
    ok = isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
    if ok and rows_only:
        ok = shape[0] == 0 or a[0].flags.c_contiguous  # every a[b] has a[0]'s strides
    elif ok:
        ok = a.flags.c_contiguous
    if not ok:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        need = "contiguous per batch element" if rows_only else "C-contiguous"
        raise ValueError(f"attention: {name} must be a {need} {np.dtype(dtype)} array "
                         f"of shape {shape}, got {got}")


def _check_qkv(q, k, v, S):
    if not isinstance(q, np.ndarray) or q.ndim != 4 or q.dtype not in (np.float32, np.float64):
        raise ValueError("attention: q must be a 4-D float32 or float64 array (B, T, NH, HS)")
    if not isinstance(k, np.ndarray) or k.ndim != 4:
        raise ValueError("attention: k must be a 4-D array (B, S, NKV, HS)")
    B, T, NH, HS = q.shape
    NKV = k.shape[2]
    if NKV < 1 or NH % NKV:
        raise ValueError(f"attention: query heads {NH} must be a multiple of kv heads {NKV}")
    _check("q", q, (B, T, NH, HS), q.dtype)
    _check("k", k, (B, S, NKV, HS), q.dtype, rows_only=True)
    _check("v", v, (B, S, NKV, HS), q.dtype, rows_only=True)
    return B, T, NH, NKV, HS


def segment_starts(segments, shape) -> np.ndarray:
    """(B, T) int64: the index of the first token of each token's segment.

    segments (B, T) int32 sample ids (module docstring); ValueError unless it has
    that shape and each row's ids form contiguous runs (no id reappears after
    another one)."""
    if not (isinstance(segments, np.ndarray) and segments.dtype == np.int32
            and segments.shape == tuple(shape)):
        got = (f"{segments.dtype} {segments.shape}" if isinstance(segments, np.ndarray)
               else type(segments).__name__)
        raise ValueError(f"attention: segments must be an int32 array of shape {tuple(shape)}, "
                         f"got {got}")
    B, T = segments.shape
    new = np.ones((B, T), bool)  # token t starts a run
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    rows, cols = np.nonzero(new)
    ids = segments[rows, cols]
    order = np.lexsort((ids, rows))
    again = (rows[order][1:] == rows[order][:-1]) & (ids[order][1:] == ids[order][:-1])
    if again.any():
        b = int(rows[order][1:][again][0])
        raise ValueError(f"attention: segments row {b}: sample id {int(ids[order][1:][again][0])} "
                         "appears in two separate runs (a sample's tokens must be adjacent)")
    return np.maximum.accumulate(np.where(new, np.arange(T), 0), axis=1)


def _blocks(T, n_past, starts, window):
    """[(i0, i1, j0, lo, hi)] per query block: keys [j0, n_past + i1) are computed,
    row i sees block-local keys [lo[i], hi[i]). starts: None or the (T,) sample
    starts of one row; window: 0 or the sliding window."""
    first = np.zeros(T, np.int64) if starts is None else starts  # first visible key
    if window:
        first = np.maximum(first, n_past + np.arange(T, dtype=np.int64) - (window - 1))
    blocks = []
    for i0 in range(0, T, _QBLOCK):
        i1 = min(i0 + _QBLOCK, T)
        hi = n_past + np.arange(i0, i1, dtype=np.int64) + 1
        # first never decreases along a row: the block's first row has the lowest
        j0 = int(first[i0])
        blocks.append((i0, i1, j0, first[i0:i1] - j0, hi - j0))
    return blocks


def _starts(segments, B, T, n_past):
    if segments is None:
        return [None] * B
    if n_past:
        raise ValueError(f"attention: segments need n_past = 0 (training), got {n_past}")
    return segment_starts(segments, (B, T))


def attention_options(dtype, HS, scale, softcap, window):
    """(scale, cap, kcap) in dtype: the q.k multiplier, the soft cap (0: none) and
    scale / cap; ValueError for a bad scale, softcap or window."""
    if scale is None:
        scale = 1.0 / np.sqrt(HS)
    elif not (isinstance(scale, (int, float, np.number)) and np.isfinite(scale) and scale > 0):
        raise ValueError(f"attention: scale must be None or a finite number > 0, got {scale!r}")
    if not (isinstance(softcap, (int, float, np.number)) and np.isfinite(softcap)
            and softcap >= 0):
        raise ValueError(f"attention: softcap must be a finite number >= 0, got {softcap!r}")
    if not (isinstance(window, (int, np.integer)) and window >= 0):
        raise ValueError(f"attention: window must be an integer >= 0 (0: no window), "
                         f"got {window!r}")
    dt = np.dtype(dtype).type
    cap = dt(softcap)
    return dt(scale), cap, (dt(scale) / cap if softcap > 0 else dt(0))


_POOL = None


def _tiles(B, NKV, pair_floats):
    """[(b, ks)]: the tiles of the work, a batch row and a slice of its kv heads, as
    many as keep the tile's score block within _TILE_FLOATS (`pair_floats` floats a
    kv head), but at least as many tiles as worker threads while heads can be split.
    Per tile, the products are numpy's batched matmuls over (kv heads, query heads)
    and each softmax one kernel call. At the bench shape (B=8, T=256, 8 heads, 4 kv
    heads, HS 64, two Zen 5 cores, OpenBLAS's AVX-512 kernels) the backward took
    7.4 ms (packed rows 5.0) against 8.6 (6.3) with a tile per (row, kv head); tiles
    of 4 rows x 4 kv heads (4 MB of scores) took 9.4 ms.
    (HS 128, 32/8 heads, B=1: the same within 5 %.)"""
    most = max(1, _TILE_FLOATS // pair_floats)
    nk = min(NKV, most)
    while B * -(-NKV // nk) < numba.get_num_threads() and nk > 1:
        nk = -(-nk // 2)
    return [(b, slice(h, min(NKV, h + nk))) for b in range(B) for h in range(0, NKV, nk)]


def _run_items(work, n_items):
    """work(items) for the work items 0..n_items-1, dealt round-robin to
    numba.get_num_threads() workers (threads of one pool), BLAS at one thread."""
    global _POOL
    nw = _workers(n_items)
    with blas_one_thread():
        if nw == 1:
            work(range(n_items))
            return
        if _POOL is None:
            _POOL = ThreadPoolExecutor(numba.config.NUMBA_NUM_THREADS, "llamatune-attention")
        for f in [_POOL.submit(work, range(w, n_items, nw)) for w in range(nw)]:
            f.result()


def _workers(n_items):
    """How many workers _run_items runs for n_items work items."""
    return max(1, min(numba.get_num_threads(), n_items))


def scratch_bytes(B, T, NH, NKV, HS, softcap=0.0, itemsize=4):
    """Bytes a training step's attention_forward or attention_backward (n_past 0, S = T)
    holds in its workers' buffers at once, the larger of the two: each worker allocates
    its `work` buffers for the largest tile (counted here as `work` sizes them) and
    _run_items runs min(threads, tiles) workers (at the bench shape, B 8 x T 256, 8/4
    heads of 64, 2 threads: 6 MiB). The memory estimate's share of attention on the CPU."""
    G, QB = NH // NKV, min(T, _QBLOCK)
    tiles = _tiles(B, NKV, G * QB * T)
    nk = tiles[0][1].stop
    forward = nk * G * QB * T                                         # scratch
    backward = ((3 if softcap > 0 else 2) * nk * G * QB * T           # scores
                + nk * G * QB * HS + nk * T * HS + 2 * QB * nk * G * HS)   # rows_copy, kv_part, od_rows
    return itemsize * _workers(len(tiles)) * max(forward, backward)


def _heads(a, G):
    """(B, T, NKV * G, HS) -> (B, T, NKV, G, HS) view."""
    B, T, _, HS = a.shape
    return a.reshape(B, T, -1, G, HS)


def _rows(a, b, i0, i1, ks):
    """A tile's query rows [i0, i1) of a (B, T, NKV, G, HS) array as an (nk, G, TQ, HS)
    view: the batched products' layout."""
    return a[b, i0:i1, ks].transpose(1, 2, 0, 3)


def _keys(a, b, j0, j1, ks, transpose=False):
    """A tile's keys [j0, j1) of a (B, S, NKV, HS) array as an (nk, 1, W, HS) view
    ((nk, 1, HS, W) transposed), broadcast over each kv head's query heads."""
    kv = a[b, j0:j1, ks]
    return (kv.transpose(1, 2, 0) if transpose else kv.transpose(1, 0, 2))[:, None]


def attention_forward(out, lse, q, k, v, n_past, segments=None, *, scale=None, softcap=0.0,
                      window=0):
    """Causal GQA attention for T new queries after n_past cached positions.

    out (B, T, NH, HS); lse (B, NH, T) saved log-sum-exp; q (B, T, NH, HS);
    k, v (B, S, NKV, HS) with S = n_past + T (may be [:, :S] slices of a cache);
    segments: None, or (B, T) int32 sample ids of packed rows (n_past = 0);
    scale: q.k multiplier (None: 1/sqrt(HS)); softcap > 0: scores
    softcap * tanh(q.k * scale / softcap); window > 0: sliding-window mask
    (module docstring).
    """
    if n_past < 0:
        raise ValueError(f"attention: n_past must be >= 0, got {n_past}")
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, n_past + T)
    _check("out", out, q.shape, q.dtype)
    _check("lse", lse, (B, NH, T), q.dtype)
    scale, cap, kcap = attention_options(q.dtype, HS, scale, softcap, window)
    row_scale = q.dtype.type(1) if softcap > 0 else scale  # capped rows are scaled already
    starts = _starts(segments, B, T, n_past)
    blocks = [_blocks(T, n_past, starts[b], window) for b in range(B)]
    G, QB, S = NH // NKV, min(T, _QBLOCK), n_past + T
    tiles = _tiles(B, NKV, G * QB * S)
    q5, out5, lse4 = _heads(q, G), _heads(out, G), lse.reshape(B, NKV, G, T)

    def work(items):
        scratch = np.empty(tiles[0][1].stop * G * QB * S, q.dtype)  # the largest tile's scores
        for item in items:
            b, ks = tiles[item]
            nk = ks.stop - ks.start
            for i0, i1, j0, lo, hi in blocks[b]:
                TQ, W = i1 - i0, n_past + i1 - j0
                att = scratch[: nk * G * TQ * W].reshape(nk, G, TQ, W)
                np.matmul(_rows(q5, b, i0, i1, ks), _keys(k, b, j0, j0 + W, ks, True), out=att)
                rows = att.reshape(nk * G, TQ, W)
                if cap:  # s = cap*tanh(q.k*kcap) in place, then softmax(s * 1)
                    _softcap_scores_kernel(rows, None, cap, kcap, scale, lo, hi)
                _softmax_causal_kernel(rows, lse4[b, ks, :, i0:i1], row_scale, lo, hi)
                np.matmul(att, _keys(v, b, j0, j0 + W, ks), out=_rows(out5, b, i0, i1, ks))

    _run_items(work, len(tiles))


def attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments=None, *, scale=None,
                       softcap=0.0, window=0):
    """Gradients of causal GQA attention for training (n_past = 0, S = T), overwritten.

    dq (B, T, NH, HS); dk, dv (B, T, NKV, HS) summed over each kv head's query heads;
    dout, q, out (B, T, NH, HS); k, v (B, T, NKV, HS); lse (B, NH, T) from the forward;
    segments, scale, softcap, window as in the forward.
    """
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, T)
    for name, a in (("dq", dq), ("dout", dout), ("out", out)):
        _check(name, a, q.shape, q.dtype)
    _check("dk", dk, k.shape, q.dtype)
    _check("dv", dv, k.shape, q.dtype)
    _check("lse", lse, (B, NH, T), q.dtype)
    scale, cap, kcap = attention_options(q.dtype, HS, scale, softcap, window)
    row_scale = q.dtype.type(1) if softcap > 0 else scale  # capped rows are scaled already
    starts = _starts(segments, B, T, 0)
    blocks = [_blocks(T, 0, starts[b], window) for b in range(B)]
    G, QB = NH // NKV, min(T, _QBLOCK)
    tiles = _tiles(B, NKV, G * QB * T)
    q5, dq5, dout5, out5 = (_heads(a, G) for a in (q, dq, dout, out))
    lse4 = lse.reshape(B, NKV, G, T)
    dk[...] = 0.0  # the query blocks add their share below
    dv[...] = 0.0

    def work(items):
        nk = tiles[0][1].stop  # the largest tile's kv heads
        scores = np.empty((3 if cap else 2, nk * G * QB * T), q.dtype)  # P, dS (, ds/dqk)
        rows_copy = np.empty(nk * G * QB * HS, q.dtype)  # q or dout rows, (G, TQ) merged
        kv_part = np.empty(nk * T * HS, q.dtype)  # a block's share of dk or dv
        # a block's out and dout rows, copied: the softmax kernel then always sees C-contiguous
        # arrays, so numba runs one compiled version of its rowsum(dout * out) whatever the tile
        # (a tile of all kv heads is contiguous, a slice of them is not, and the two versions
        # group that sum differently: the bits depended on the tiling)
        od_rows = np.empty((2, QB * nk * G * HS), q.dtype)
        for item in items:
            b, ks = tiles[item]
            nk = ks.stop - ks.start
            for i0, i1, j0, lo, hi in blocks[b]:
                TQ, W = i1 - i0, i1 - j0
                n = nk * G * TQ * W
                att, dp = (scores[j, :n].reshape(nk, G, TQ, W) for j in (0, 1))
                qb, dob = _rows(q5, b, i0, i1, ks), _rows(dout5, b, i0, i1, ks)
                kb = _keys(k, b, j0, i1, ks)
                np.matmul(qb, kb.swapaxes(-1, -2), out=att)
                np.matmul(dob, _keys(v, b, j0, i1, ks, True), out=dp)
                rows, drows = att.reshape(-1, TQ, W), dp.reshape(-1, TQ, W)
                if cap:  # the capped scores s and ds/d(q.k) (deriv), then dS = dS(s) * deriv
                    deriv = scores[2, :n].reshape(-1, TQ, W)
                    _softcap_scores_kernel(rows, deriv, cap, kcap, scale, lo, hi)
                oc, dc = (od_rows[j, : TQ * nk * G * HS].reshape(TQ, nk, G, HS) for j in (0, 1))
                oc[...], dc[...] = out5[b, i0:i1, ks], dout5[b, i0:i1, ks]
                _softmax_causal_backward_kernel(rows, drows, lse4[b, ks, :, i0:i1], oc, dc, row_scale, lo, hi)
                if cap:
                    drows *= deriv
                # dq rows of this block are complete: the block saw all their keys
                np.matmul(dp, kb, out=_rows(dq5, b, i0, i1, ks))
                # dk, dv: contract over (G, TQ) at once, i.e. sum over the group's heads
                part = kv_part[: nk * W * HS].reshape(nk, W, HS)
                for grad, ds, x in ((dk, dp, qb), (dv, att, dob)):
                    xc = rows_copy[: nk * G * TQ * HS].reshape(nk, G, TQ, HS)
                    xc[...] = x
                    np.matmul(ds.reshape(nk, G * TQ, W).swapaxes(-1, -2), xc.reshape(nk, G * TQ, HS),
                              out=part)
                    grad[b, j0:i1, ks] += part.transpose(1, 0, 2)

    _run_items(work, len(tiles))


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks; plain
# per-head loops with a full masked (T, S) softmax; segments mask by id equality,
# the window by position difference


def _probs_ref(q, k, b, h, kvh, n_past, segments=None, scale=None, softcap=0.0, window=0):
    """P (T, S), lse (T,) and ds/d(q.k) (T, S) of one head."""
    T, S = q.shape[1], k.shape[1]
    scale = 1 / np.sqrt(q.shape[3]) if scale is None else scale
    s = q[b, :, h] @ k[b, :, kvh].T * scale  # (T, S)
    ds = np.full_like(s, scale)
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
        ds *= 1 - t * t
    p1, p0 = n_past + np.arange(T)[:, None], np.arange(S)[None, :]  # query, key positions
    visible = p0 <= p1
    if window > 0:
        visible &= p1 - p0 < window
    if segments is not None:
        visible &= segments[b][None, :] == segments[b][:, None]
    s = np.where(visible, s, -np.inf)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    return e / e.sum(axis=1, keepdims=True), (mx + np.log(e.sum(axis=1, keepdims=True)))[:, 0], ds


def attention_forward_ref(out, lse, q, k, v, n_past, segments=None, *, scale=None, softcap=0.0,
                          window=0):
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    for b in range(B):
        for h in range(NH):
            P, lse[b, h], _ = _probs_ref(q, k, b, h, h // G, n_past, segments, scale, softcap,
                                         window)
            out[b, :, h] = P @ v[b, :, h // G]


def attention_backward_ref(dq, dk, dv, dout, q, k, v, out, lse, segments=None, *, scale=None,
                           softcap=0.0, window=0):
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    dk[...] = 0.0
    dv[...] = 0.0
    for b in range(B):
        for h in range(NH):
            P, _, ds = _probs_ref(q, k, b, h, h // G, 0, segments, scale, softcap, window)
            dP = dout[b, :, h] @ v[b, :, h // G].T
            dS = P * (dP - np.sum(P * dP, axis=1, keepdims=True)) * ds
            dq[b, :, h] = dS @ k[b, :, h // G]
            dk[b, :, h // G] += dS.T @ q[b, :, h]
            dv[b, :, h // G] += P.T @ dout[b, :, h]
