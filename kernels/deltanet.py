"""The gated delta rule of Qwen3.5 / Qwen3-Next's linear-attention layers, forward and
backward (BLAS + numba + numpy references).

Per value head h, a state S (DK, DV) runs along the sequence; at step t

    S = exp(g_t) S                          (decay, g_t <= 0 in the models)
    S = S + k_t (beta_t (v_t - S^T k_t))^T  (the delta rule: write the error of S's read)
    o_t = S^T q_t

with q_t, k_t l2-normalized, q_t scaled by 1/sqrt(DK). This is the order of HF
transformers' `torch_recurrent_gated_delta_rule` (modeling_qwen3_5.py) and of
ggml's GATED_DELTA_NET op (ggml-cpu ops.cpp), which llama.cpp's qwen35/qwen3next
graphs use (src/models/delta-net-base.cpp). ggml stores each state transposed,
(DV, DK) row-major; this module stores it as HF does, (B, NV, DK, DV).

Options (keyword arguments):
* l2norm (True): q and k become x * rsqrt(sum(x^2) + 1e-6) first, HF's `l2norm` and
  llama.cpp's `build_gdn_l2_norm` (rms_norm(x, eps/n) / sqrt(n): the same); the
  backward goes through it.
* scale (None: 1/sqrt(DK)): the q multiplier, applied after the normalization.
* heads ("grouped"): which of the NK q/k heads value head h reads when NV > NK (G =
  NV // NK). "grouped": h // G, HF's repeat_interleave; "tiled": h % NK, ggml's
  broadcast, for which llama.cpp's convert_hf_to_gguf.py (_LinearAttentionVReorderBase)
  reorders the value heads of a GGUF's tensors.

Shapes: q, k (B, T, NK, DK); v (B, T, NV, DV); g, beta (B, T, NV); out (B, T, NV, DV);
states (B, NV, DK, DV).

Forms:
* `deltanet_decode`: the recurrence itself, one step after another (a numba kernel
  over (batch row, value head)), with the state updated in place: decoding, where
  the state replaces the KV cache.
* `deltanet_forward` / `deltanet_backward`: the chunked parallel form for training,
  HF's `torch_chunk_gated_delta_rule` (the WY / UT-transform algorithm of the
  DeltaNet papers, chunks of C = 64 steps; a last, shorter chunk is padded with
  g = beta = 0 and k = v = 0, which leaves the state as it is). Within chunk n, with
  gc the cumulative sum of g over the chunk, gl its last entry, Gam_ij =
  exp(gc_i - gc_j) for j <= i (0 above), S_n the state entering the chunk:
      L = I + strictly_lower(beta_i k_i.k_j Gam_ij)       (C, C), unit lower
      U = L^-1 (beta v);   W = L^-1 (beta exp(gc) k)       (the UT transform)
      Vn = U - W S_n                                       (the chunk's corrections)
      o = (exp(gc) q) S_n + (q k^T * Gam) Vn
      S_n+1 = exp(gl) S_n + (exp(gl - gc) k)^T Vn
  Everything but the last three lines is done for all chunks at once (batched
  numpy matmuls over (heads, chunks)); L^-1 is built by forward substitution in a
  numba kernel (HF's export path does the same). The loop over chunks carries S.
  The backward recomputes all of it (nothing is saved between the passes but the
  inputs: memory grows linearly with T), then runs the loop in reverse for dS and
  gets every other gradient from batched products (derivation in `_chunk_backward`'s
  docstring). Gradients, all overwritten: dq, dk, dv, dg, dbeta, and the
  initial state's when one was given; the final state's gradient is an optional input.

Packed rows (training): an optional `segments` (B, T) int32 gives each token's sample
id, as attention's (contiguous runs, `attention.segment_starts`); each sample then
runs from a zero state, as if alone (HF's FLA path does this with cu_seqlens).
Work is dealt as attention's is (kernels/attention.py `_run_items`): one item per
(batch row, or sample of a packed row; q/k head) with the G value heads that read
it, each on a worker thread with single-threaded BLAS, so dq and dk need no
reduction across threads. A sample's last chunk is padded on its own. An item runs
in groups of at most GROUP_CHUNKS chunks (2048 steps), the state carried from one to
the next (the backward first runs the groups but the last forward for the states
between them), so its working memory stops growing with T past 2048 steps.

Speed and memory (bench/deltanet.py, Qwen3.5-4B's shapes, 2 threads): forward +
backward of the rule is 1.08-1.23x causal attention of the same width at ctx 2048
(about a third of attention's FLOPs, in smaller products); at ctx 512, 2.9-3.1x. Working
memory is per work item in flight, linear in T up to a group: 77 MB forward, 126 MB
backward at ctx 2048 (padded head copies, (C, C) matrices and the states of every chunk).
"""

import numpy as np
import numba
from numba import njit, prange

from ._checks import check_array
from .attention import _run_items, segment_starts

CHUNK = 64  # steps per chunk of the parallel form (HF's and fla's chunk_size)
GROUP_CHUNKS = 32  # chunks an item processes at once: its working memory stops growing past 2048 steps
L2NORM_EPS = 1e-6  # HF's l2norm eps; llama.cpp passes f_norm_rms_eps (1e-6 in Qwen3.5)
HEAD_ORDERS = ("grouped", "tiled")


# ----------------------------------------------------------------------------
# numba kernels


@njit(cache=True, nogil=True)
def _decays_kernel(gam, gc):
    # gam (R, C, C) out: exp(gc[r, i] - gc[r, j]) for j <= i, 0 above; gc (R, C) the
    # cumulative log decays of R chunks (the masked part never reaches exp: no overflow)
    R, C = gc.shape
    for r in range(R):
        for i in range(C):
            for j in range(i + 1):
                gam[r, i, j] = np.exp(gc[r, i] - gc[r, j])
            for j in range(i + 1, C):
                gam[r, i, j] = 0.0


@njit(cache=True, nogil=True)
def _unit_lower_inverse_kernel(inv, m):
    # inv (R, C, C) out: (I + strictly_lower(m))^-1 for each of R matrices m (R, C, C)
    # (m's diagonal and upper triangle are not read); unit lower triangular, built row
    # by row: inv[i, :i] = -m[i, :i] inv[:i, :i]
    R, C = m.shape[:2]
    for r in range(R):
        x = inv[r]
        for i in range(C):
            for j in range(C):
                x[i, j] = 0.0
            x[i, i] = 1.0
            for c in range(i):
                f = m[r, i, c]
                for j in range(c + 1):
                    x[i, j] -= f * x[c, j]


@njit(cache=True, parallel=True)
def _decode_kernel(out, state, q, k, v, g, beta, scale, eps, l2norm, tiled):
    # the recurrence step by step, state (B, NV, DK, DV) updated in place; each
    # (batch row, value head) is independent
    B, T, NV, DV = v.shape
    NK, DK = q.shape[2], q.shape[3]
    G = NV // NK
    for bh in prange(B * NV):
        b, h = bh // NV, bh % NV
        kh = h % NK if tiled else h // G
        S = state[b, h]
        qn = np.empty(DK, q.dtype)
        kn = np.empty(DK, q.dtype)
        d = np.empty(DV, q.dtype)
        for t in range(T):
            rq, rk = scale, q.dtype.type(1)
            if l2norm:
                sq, sk = 0.0, 0.0
                for i in range(DK):
                    sq += q[b, t, kh, i] * q[b, t, kh, i]
                    sk += k[b, t, kh, i] * k[b, t, kh, i]
                rq = scale / np.sqrt(sq + eps)
                rk = 1 / np.sqrt(sk + eps)
            for i in range(DK):
                qn[i] = q[b, t, kh, i] * rq
                kn[i] = k[b, t, kh, i] * rk
            a = np.exp(g[b, t, h])
            for j in range(DV):
                d[j] = 0.0
            for i in range(DK):  # S = a S;  d = S^T k
                for j in range(DV):
                    S[i, j] *= a
                    d[j] += S[i, j] * kn[i]
            for j in range(DV):
                d[j] = beta[b, t, h] * (v[b, t, h, j] - d[j])
            for j in range(DV):
                out[b, t, h, j] = 0.0
            for i in range(DK):  # S += k d^T;  o = S^T q
                for j in range(DV):
                    S[i, j] += kn[i] * d[j]
                    out[b, t, h, j] += S[i, j] * qn[i]


# ----------------------------------------------------------------------------
# the chunked form of one work item: a batch row, a q/k head and its G value heads


class _Item:
    """A work item's inputs, head-major and padded to N chunks of C steps:
    qn, kn (N, C, DK) normalized (q scaled too), with rq, rk (Tp,) their factors
    (the l2 norms' reciprocals, scale included for q); v (G, N, C, DV); g, beta (G, N, C)."""

    def __init__(self, q, k, v, g, beta, b, ts, kh, hs, opts):
        # the steps ts (a slice) of batch row b
        T, DK = ts.stop - ts.start, q.shape[3]
        C = opts.chunk
        N = max(1, -(-T // C))
        Tp, G, dt = N * C, len(hs), q.dtype
        self.T, self.N, self.C, self.G = T, N, C, G
        self.q0, self.k0 = np.zeros((Tp, DK), dt), np.zeros((Tp, DK), dt)
        self.q0[:T], self.k0[:T] = q[b, ts, kh], k[b, ts, kh]
        self.rq, self.rk = _l2_factors(self.q0, opts), _l2_factors(self.k0, opts)
        self.rq *= opts.scale
        self.qn = (self.q0 * self.rq[:, None]).reshape(N, C, DK)
        self.kn = (self.k0 * self.rk[:, None]).reshape(N, C, DK)
        self.v = _padded(v[b, ts][:, hs].transpose(1, 0, 2), Tp).reshape(G, N, C, -1)
        self.g = _padded(g[b, ts][:, hs].T, Tp).reshape(G, N, C)
        self.beta = _padded(beta[b, ts][:, hs].T, Tp).reshape(G, N, C)


def _padded(a, Tp):
    """(G, T, ...) -> (G, Tp, ...) with zeros after T."""
    out = np.zeros((a.shape[0], Tp) + a.shape[2:], a.dtype)
    out[:, : a.shape[1]] = a
    return out


def _l2_factors(x, opts):
    """(Tp,) 1 / sqrt(sum(x^2) + eps) of each row of x (Tp, D), or ones without l2norm."""
    if not opts.l2norm:
        return np.ones(x.shape[0], x.dtype)
    return (1 / np.sqrt(np.einsum("td,td->t", x, x) + x.dtype.type(opts.eps))).astype(x.dtype)


class _Intra:
    """The state-independent quantities of every chunk of an item (module docstring):
    gc (G, N, C) cumulative decays, eg = exp(gc), el (G, N) = exp(gl); gam (G, N, C, C);
    kk, qk (N, C, C) the chunks' k k^T, q k^T; m = beta_i kk gam (G, N, C, C), whose
    strictly lower part is L - I; inv = L^-1; x = [beta v | beta eg k] (G, N, C, DV + DK)
    and uw = inv x = [U | W]; a = qk gam; qg = eg q, ed = exp(gl - gc) (G, N, C), kd = ed k (G, N, C, DK)."""

    def __init__(self, it):
        G, N, C = it.G, it.N, it.C
        DV = it.v.shape[-1]
        self.gc = np.cumsum(it.g, axis=-1)
        self.eg = np.exp(self.gc)
        self.el = self.eg[..., -1]
        self.gam = np.empty((G, N, C, C), it.v.dtype)
        _decays_kernel(self.gam.reshape(G * N, C, C), self.gc.reshape(G * N, C))
        self.kk = it.kn @ it.kn.swapaxes(-1, -2)
        self.qk = it.qn @ it.kn.swapaxes(-1, -2)
        self.m = it.beta[..., None] * self.kk * self.gam
        self.inv = np.empty_like(self.m)
        _unit_lower_inverse_kernel(self.inv.reshape(G * N, C, C), self.m.reshape(G * N, C, C))
        self.x = np.concatenate([it.beta[..., None] * it.v,
                                 (it.beta * self.eg)[..., None] * it.kn], axis=-1)
        self.uw = self.inv @ self.x
        self.u, self.w = self.uw[..., :DV], self.uw[..., DV:]
        self.a = self.qk * self.gam
        self.qg = it.qn * self.eg[..., None]
        self.ed = np.exp(self.gc[..., -1:] - self.gc)
        self.kd = it.kn * self.ed[..., None]


def _chunk_states(ia, s0):
    """The loop over chunks: states (G, N + 1, DK, DV), states[:, n] entering chunk n
    (states[:, 0] = s0, states[:, N] the final state), and the corrections vn (G, N, C, DV)."""
    G, N, C, DK = ia.w.shape
    DV = ia.u.shape[-1]
    states = np.empty((G, N + 1, DK, DV), ia.u.dtype)
    states[:, 0] = s0
    vn = np.empty_like(ia.u)
    upd = np.empty((G, DK, DV), ia.u.dtype)
    for n in range(N):
        np.matmul(ia.w[:, n], states[:, n], out=vn[:, n])
        np.subtract(ia.u[:, n], vn[:, n], out=vn[:, n])
        np.matmul(ia.kd[:, n].swapaxes(-1, -2), vn[:, n], out=upd)
        np.multiply(states[:, n], ia.el[:, n, None, None], out=states[:, n + 1])
        states[:, n + 1] += upd
    return states, vn


def _final_state(it, s0):
    """The state (G, DK, DV) after an item's steps, from state s0."""
    return _chunk_states(_Intra(it), s0)[0][:, -1].copy()


def _chunk_forward(it, s0):
    """out (G, N, C, DV) and the final state (G, DK, DV) of an item from state s0."""
    ia = _Intra(it)
    states, vn = _chunk_states(ia, s0)
    out = ia.qg @ states[:, :-1]
    out += ia.a @ vn
    return out, states[:, -1]


def _chunk_backward(it, s0, dout, ds_final):
    """Gradients of an item: dqn, dkn (N, C, DK) of the normalized q, k (summed over the
    G value heads), dv (G, N, C, DV), dg, dbeta (G, N, C) and ds0 (G, DK, DV), from
    dout (G, N, C, DV) and ds_final (G, DK, DV), the final state's gradient.

    Reverse mode through the forward's lines (module docstring), chunk by chunk:
      o = qg S + a vn:            dqg = do S^T, da = do vn^T, dvn = a^T do, dS = qg^T do
      S' = el S + kd^T vn:        dvn += kd dS', dkd = vn dS'^T, dS += el dS', del = <dS', S>
      vn = u - w S:               du = dvn, dw = -dvn S^T, dS -= w^T dvn
      [u | w] = L^-1 x:           dx = L^-T [du | dw], dL = -dx [u | w]^T (strictly lower: dm)
    then the products' factors: x = [beta v | beta eg k], m = beta kk gam, a = qk gam,
    qg = eg q, kd = ed k, with gam_ij = exp(gc_i - gc_j) giving dgc_i += sum_j p_ij and
    dgc_j -= sum_i p_ij for p = da * a + dm * m, and dg the reverse cumsum of dgc."""
    ia = _Intra(it)
    states, vn = _chunk_states(ia, s0)
    G, N, C, DK = ia.w.shape
    DV = ia.u.shape[-1]
    S = states[:, :-1]
    dqg = dout @ S.swapaxes(-1, -2)
    da = dout @ vn.swapaxes(-1, -2)  # above the diagonal it meets gam = 0 only
    dvn = ia.a.swapaxes(-1, -2) @ dout
    qdo = ia.qg.swapaxes(-1, -2) @ dout
    ds = np.empty_like(states)
    ds[:, N] = ds_final
    part = np.empty((G, C, DV), dout.dtype)
    back = np.empty((G, DK, DV), dout.dtype)
    for n in range(N - 1, -1, -1):  # the loop over chunks, reversed: dS entering each chunk
        np.matmul(ia.kd[:, n], ds[:, n + 1], out=part)
        dvn[:, n] += part
        np.matmul(ia.w[:, n].swapaxes(-1, -2), dvn[:, n], out=back)
        np.multiply(ds[:, n + 1], ia.el[:, n, None, None], out=ds[:, n])
        ds[:, n] += qdo[:, n]
        ds[:, n] -= back
    dkd = vn @ ds[:, 1:].swapaxes(-1, -2)
    dgl = ia.el * np.einsum("gnij,gnij->gn", ds[:, 1:], S)
    dx = ia.inv.swapaxes(-1, -2) @ np.concatenate([dvn, -(dvn @ S.swapaxes(-1, -2))], axis=-1)
    dm = dx @ ia.uw.swapaxes(-1, -2)
    dm *= -1
    dm.reshape(G * N, C * C)[:, :: C + 1] = 0  # L's diagonal is 1, not a function of m
    dxu, dxw = dx[..., :DV], dx[..., DV:]
    dgc, dbeta = _decay_beta_grads(it, ia, dqg, dxw, dkd, da, dm, dgl)
    dg = np.cumsum(dgc[..., ::-1], axis=-1)[..., ::-1]  # gc_i = sum_{t <= i} g_t
    dbeta += np.einsum("gncd,gncd->gnc", dxu, it.v)
    dag = (da * ia.gam).sum(axis=0)  # q and k are shared by the G heads: sum first
    dmg = (dm * ia.gam * it.beta[..., None]).sum(axis=0)
    dqn = np.einsum("gncd,gnc->ncd", dqg, ia.eg) + dag @ it.kn
    dkn = (dag.swapaxes(-1, -2) @ it.qn + dmg @ it.kn + dmg.swapaxes(-1, -2) @ it.kn
           + np.einsum("gncd,gnc->ncd", dkd, ia.ed)
           + np.einsum("gncd,gnc->ncd", dxw, it.beta * ia.eg))
    return dqn, dkn, it.beta[..., None] * dxu, dg, dbeta, ds[:, 0]


def _decay_beta_grads(it, ia, dqg, dxw, dkd, da, dm, dgl):
    """dgc (G, N, C), the gradient of the cumulative decays, and dbeta's parts through
    w and m (G, N, C); see _chunk_backward."""
    rows = "gncd,gncd->gnc"  # a row-wise dot product
    p = da * ia.a + dm * ia.m
    kdk = np.einsum(rows, dkd, ia.kd)
    xw = ia.x[..., -dxw.shape[-1]:]
    dgc = np.einsum(rows, dqg, ia.qg) + np.einsum(rows, dxw, xw) - kdk + p.sum(axis=-1) - p.sum(axis=-2)
    dgc[..., -1] += kdk.sum(axis=-1) + dgl  # gl = gc[-1]: through ed = exp(gl - gc) and el
    dbeta = (np.einsum("gncd,ncd->gnc", dxw, it.kn) * ia.eg
             + np.einsum("gnij,nij,gnij->gni", dm, ia.kk, ia.gam))
    return dgc, dbeta


def _l2_backward(dy, x, r, c, l2norm):
    """dx (Tp, D) of y = x * r, r = c / sqrt(sum(x^2) + eps) per row (r = c without
    l2norm), from dy (Tp, D)."""
    dx = dy * r[:, None]
    if l2norm:
        dot = np.einsum("td,td->t", x, dy)
        dx -= x * (r ** 3 / x.dtype.type(c * c) * dot)[:, None]
    return dx


# ----------------------------------------------------------------------------
# entry points


class _Options:
    """The options of one call, checked: scale (in q's dtype), l2norm, eps, tiled, chunk, group."""

    def __init__(self, dtype, DK, scale, l2norm, heads):
        if scale is None:
            scale = 1.0 / np.sqrt(DK)
        elif not (isinstance(scale, (int, float, np.number)) and np.isfinite(scale) and scale > 0):
            raise ValueError(f"deltanet: scale must be None or a finite number > 0, got {scale!r}")
        if heads not in HEAD_ORDERS:
            raise ValueError(f"deltanet: heads must be one of {HEAD_ORDERS}, got {heads!r}")
        self.scale = np.dtype(dtype).type(scale)
        self.l2norm, self.eps, self.tiled = bool(l2norm), L2NORM_EPS, heads == "tiled"
        self.chunk, self.group = CHUNK, GROUP_CHUNKS


def _check_inputs(q, k, v, g, beta):
    """(B, T, NK, NV, DK, DV) of valid inputs; ValueError naming the first bad one."""
    if not isinstance(q, np.ndarray) or q.ndim != 4 or q.dtype not in (np.float32, np.float64):
        raise ValueError("deltanet: q must be a 4-D float32 or float64 array (B, T, NK, DK)")
    if not isinstance(v, np.ndarray) or v.ndim != 4:
        raise ValueError("deltanet: v must be a 4-D array (B, T, NV, DV)")
    B, T, NK, DK = q.shape
    NV, DV = v.shape[2], v.shape[3]
    if NK < 1 or NV % NK:
        raise ValueError(f"deltanet: value heads {NV} must be a multiple of q/k heads {NK}")
    for name, a, shape in (("q", q, q.shape), ("k", k, q.shape), ("v", v, (B, T, NV, DV)),
                           ("g", g, (B, T, NV)), ("beta", beta, (B, T, NV))):
        check_array("deltanet", name, a, shape, q.dtype)
    return B, T, NK, NV, DK, DV


def _check_state(name, a, B, NV, DK, DV, dtype, optional=True):
    if a is None and optional:
        return
    check_array("deltanet", name, a, (B, NV, DK, DV), dtype)


def _items(B, T, NK, segments, *states):
    """[(b, ts, kh)]: the work items, a batch row's steps ts (a slice: the whole row, or one
    sample of a packed row) and a q/k head. With segments, the states must be None."""
    if segments is None:
        runs = [(b, slice(0, T)) for b in range(B)]
    else:
        if any(s is not None for s in states):
            raise ValueError("deltanet: segments (packed rows) start every sample from a zero state: "
                             "no initial or final state")
        try:
            starts = segment_starts(segments, (B, T))
        except ValueError as e:
            raise ValueError(str(e).replace("attention:", "deltanet:")) from None
        runs = []
        for b in range(B):
            cuts = [int(t) for t in np.flatnonzero(starts[b] == np.arange(T))] + [T]
            runs += [(b, slice(t0, t1)) for t0, t1 in zip(cuts[:-1], cuts[1:])]
    return [(b, ts, kh) for b, ts in runs for kh in range(NK)]


def _groups(ts, opts):
    """The steps ts (a slice) in runs of at most GROUP_CHUNKS chunks, in order."""
    n = opts.group * opts.chunk
    return [slice(t, min(ts.stop, t + n)) for t in range(ts.start, max(ts.stop, ts.start + 1), n)]


def _value_heads(kh, NK, NV, tiled):
    """The value heads that read q/k head kh."""
    return np.arange(kh, NV, NK) if tiled else np.arange(kh * (NV // NK), (kh + 1) * (NV // NK))


def item_working_floats(T: int, G: int, DK: int, DV: int) -> int:
    """Floats a backward work item of T steps and G value heads holds at its peak (the
    forward's are fewer): its group's padded steps Tp (at most GROUP_CHUNKS chunks) times
    the arrays' widths, counted from _Item, _Intra, _chunk_states and _chunk_backward:
    per step q0, k0, qn, kn, their gradients and l2 terms (6 DK), kk, qk and the summed
    dag, dmg (4 C); per step and value head v, do, vn, dvn (4 DV), x, uw, dx and its
    operand (4 (DK + DV)), qg, kd, dqg, dkd, dvn S^T (5 DK), gam, m, inv, a, da, dm and
    the decay terms (8 C); per chunk and value head states, ds and qdo (3 DK DV).
    Covers tracemalloc's peak: 1.03-1.10x of it at Qwen3.5-4B's and small shapes."""
    C = CHUNK
    N = max(1, -(-min(T, GROUP_CHUNKS * C) // C))
    Tp = N * C
    per_head = Tp * (4 * DV + 4 * (DK + DV) + 5 * DK + 8 * C) + 3 * (N + 1) * DK * DV
    return Tp * (6 * DK + 4 * C) + G * per_head


def working_floats(B: int, T: int, NK: int, NV: int, DK: int, DV: int, threads: int | None = None) -> int:
    """Floats the backward's work items in flight hold together (item_working_floats
    times the worker threads that run them, `threads` or numba's): without packed rows,
    B NK items of T steps."""
    nw = max(1, min(numba.get_num_threads() if threads is None else threads, B * NK))
    return nw * item_working_floats(T, NV // NK, DK, DV)


def deltanet_forward(out, state_out, q, k, v, g, beta, state_in=None, segments=None, *, scale=None,
                     l2norm=True, heads="grouped"):
    """The gated delta rule over T steps, chunked (training and prefill).

    out (B, T, NV, DV); state_out: None or (B, NV, DK, DV), the final state (may be
    state_in itself); q, k (B, T, NK, DK); v (B, T, NV, DV); g, beta (B, T, NV);
    state_in: None (zeros) or (B, NV, DK, DV); segments: None, or (B, T) int32 sample
    ids of packed rows (training: the state starts from zeros at each sample; no
    state_in or state_out); options in the module docstring.
    """
    B, T, NK, NV, DK, DV = _check_inputs(q, k, v, g, beta)
    check_array("deltanet", "out", out, v.shape, q.dtype)
    _check_state("state_out", state_out, B, NV, DK, DV, q.dtype)
    _check_state("state_in", state_in, B, NV, DK, DV, q.dtype)
    opts = _Options(q.dtype, DK, scale, l2norm, heads)
    items = _items(B, T, NK, segments, state_in, state_out)

    def work(ids):
        for i in ids:
            b, ts, kh = items[i]
            hs = _value_heads(kh, NK, NV, opts.tiled)
            s = np.zeros((len(hs), DK, DV), q.dtype) if state_in is None else state_in[b, hs]
            for gs in _groups(ts, opts):  # the state carried from group to group
                it = _Item(q, k, v, g, beta, b, gs, kh, hs, opts)
                o, s = _chunk_forward(it, s)
                out[b, gs][:, hs] = o.reshape(len(hs), -1, DV)[:, : it.T].transpose(1, 0, 2)
            if state_out is not None:
                state_out[b, hs] = s

    _run_items(work, len(items))


def deltanet_backward(dq, dk, dv, dg, dbeta, dstate_in, dout, q, k, v, g, beta, state_in=None,
                      dstate_out=None, segments=None, *, scale=None, l2norm=True, heads="grouped"):
    """Gradients of deltanet_forward, overwritten: dq, dk (B, T, NK, DK); dv (B, T, NV, DV);
    dg, dbeta (B, T, NV); dstate_in: None or (B, NV, DK, DV), the initial state's;
    dout (B, T, NV, DV); dstate_out: None (zero) or (B, NV, DK, DV), the final state's;
    the forward's inputs, segments and options.
    """
    B, T, NK, NV, DK, DV = _check_inputs(q, k, v, g, beta)
    for name, a, like in (("dq", dq, q), ("dk", dk, q), ("dv", dv, v), ("dg", dg, g),
                          ("dbeta", dbeta, g), ("dout", dout, v)):
        check_array("deltanet", name, a, like.shape, q.dtype)
    for name, a in (("dstate_in", dstate_in), ("state_in", state_in), ("dstate_out", dstate_out)):
        _check_state(name, a, B, NV, DK, DV, q.dtype)
    opts = _Options(q.dtype, DK, scale, l2norm, heads)
    items = _items(B, T, NK, segments, state_in, dstate_out, dstate_in)

    def work(ids):
        for i in ids:
            b, ts, kh = items[i]
            hs = _value_heads(kh, NK, NV, opts.tiled)
            zero = np.zeros((len(hs), DK, DV), q.dtype)
            groups = _groups(ts, opts)
            starts = [zero if state_in is None else state_in[b, hs]]  # the state entering each group
            for gs in groups[:-1]:
                starts.append(_final_state(_Item(q, k, v, g, beta, b, gs, kh, hs, opts), starts[-1]))
            ds = zero if dstate_out is None else dstate_out[b, hs]
            for gs, s0 in zip(groups[::-1], starts[::-1]):  # dS carried back from group to group
                ds = group_backward(b, gs, kh, hs, s0, ds)
            if dstate_in is not None:
                dstate_in[b, hs] = ds

    def group_backward(b, gs, kh, hs, s0, ds1):
        """The gradients of the steps gs of an item, written; returns dS entering them."""
        G, T = len(hs), gs.stop - gs.start
        it = _Item(q, k, v, g, beta, b, gs, kh, hs, opts)
        do = _padded(dout[b, gs][:, hs].transpose(1, 0, 2), it.N * it.C).reshape(G, it.N, it.C, DV)
        dqn, dkn, dvh, dgh, dbh, ds0 = _chunk_backward(it, s0, do, ds1)
        dq[b, gs, kh] = _l2_backward(dqn.reshape(-1, DK), it.q0, it.rq, opts.scale, opts.l2norm)[:T]
        dk[b, gs, kh] = _l2_backward(dkn.reshape(-1, DK), it.k0, it.rk, 1, opts.l2norm)[:T]
        dv[b, gs][:, hs] = dvh.reshape(G, -1, DV)[:, :T].transpose(1, 0, 2)
        dg[b, gs][:, hs] = dgh.reshape(G, -1)[:, :T].T
        dbeta[b, gs][:, hs] = dbh.reshape(G, -1)[:, :T].T
        return ds0

    _run_items(work, len(items))


def deltanet_decode(out, state, q, k, v, g, beta, *, scale=None, l2norm=True, heads="grouped"):
    """The recurrence step by step (decoding): out (B, T, NV, DV); state (B, NV, DK, DV)
    in and out (updated in place); inputs and options as deltanet_forward's."""
    B, T, NK, NV, DK, DV = _check_inputs(q, k, v, g, beta)
    check_array("deltanet", "out", out, v.shape, q.dtype)
    _check_state("state", state, B, NV, DK, DV, q.dtype, optional=False)
    opts = _Options(q.dtype, DK, scale, l2norm, heads)
    _decode_kernel(out, state, q, k, v, g, beta, opts.scale, opts.eps, opts.l2norm, opts.tiled)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks; the
# recurrence step by step in HF's order, and its backward through time


def _normalized_ref(q, k, scale, l2norm):
    """q, k normalized (and q scaled), with the factors: (qn, kn, rq, rk)."""
    scale = 1 / np.sqrt(q.shape[3]) if scale is None else scale
    rq = rk = np.ones(q.shape[:3], q.dtype)
    if l2norm:
        rq = 1 / np.sqrt(np.sum(q * q, axis=-1) + L2NORM_EPS)
        rk = 1 / np.sqrt(np.sum(k * k, axis=-1) + L2NORM_EPS)
    rq = rq * scale
    return q * rq[..., None], k * rk[..., None], rq, rk, scale


def _kv_head(h, NK, NV, heads):
    return h % NK if heads == "tiled" else h // (NV // NK)


def _firsts_ref(segments, B, T):
    """(B, T) bool: token t starts a sample (a new run of ids; never t = 0 without segments)."""
    first = np.zeros((B, T), bool)
    if segments is not None:
        first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return first


def deltanet_forward_ref(out, state_out, q, k, v, g, beta, state_in=None, segments=None, *, scale=None,
                         l2norm=True, heads="grouped"):
    B, T, NK, _ = q.shape
    NV = v.shape[2]
    qn, kn, *_ = _normalized_ref(q, k, scale, l2norm)
    first = _firsts_ref(segments, B, T)
    for b in range(B):
        for h in range(NV):
            kh = _kv_head(h, NK, NV, heads)
            S = np.zeros((q.shape[3], v.shape[3]), q.dtype) if state_in is None else state_in[b, h].copy()
            for t in range(T):
                if first[b, t]:  # a new sample of a packed row
                    S = np.zeros_like(S)
                S = S * np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - S.T @ kn[b, t, kh])
                S = S + np.outer(kn[b, t, kh], delta)
                out[b, t, h] = S.T @ qn[b, t, kh]
            if state_out is not None:
                state_out[b, h] = S


def deltanet_decode_ref(out, state, q, k, v, g, beta, *, scale=None, l2norm=True, heads="grouped"):
    deltanet_forward_ref(out, state, q, k, v, g, beta, state.copy(), scale=scale, l2norm=l2norm,
                         heads=heads)


def deltanet_backward_ref(dq, dk, dv, dg, dbeta, dstate_in, dout, q, k, v, g, beta, state_in=None,
                          dstate_out=None, segments=None, *, scale=None, l2norm=True, heads="grouped"):
    B, T, NK, DK = q.shape
    NV, DV = v.shape[2], v.shape[3]
    qn, kn, rq, rk, scale = _normalized_ref(q, k, scale, l2norm)
    first = _firsts_ref(segments, B, T)
    dqn, dkn = np.zeros_like(q), np.zeros_like(k)
    for b in range(B):
        for h in range(NV):
            kh = _kv_head(h, NK, NV, heads)
            S = np.zeros((DK, DV), q.dtype) if state_in is None else state_in[b, h].copy()
            saved = []  # (S1 = decayed state, delta, S^T k) of each step
            for t in range(T):
                if first[b, t]:
                    S = np.zeros_like(S)
                S1 = S * np.exp(g[b, t, h])
                kv = S1.T @ kn[b, t, kh]
                delta = beta[b, t, h] * (v[b, t, h] - kv)
                saved.append((S1, delta, kv))
                S = S1 + np.outer(kn[b, t, kh], delta)
            dS = np.zeros((DK, DV), q.dtype) if dstate_out is None else dstate_out[b, h].copy()
            for t in range(T - 1, -1, -1):
                S1, delta, kv = saved[t]
                S2 = S1 + np.outer(kn[b, t, kh], delta)
                dS = dS + np.outer(qn[b, t, kh], dout[b, t, h])  # o = S2^T q
                dqn[b, t, kh] += S2 @ dout[b, t, h]
                ddelta = dS.T @ kn[b, t, kh]  # S2 = S1 + k delta^T
                dkn[b, t, kh] += dS @ delta
                dv[b, t, h] = beta[b, t, h] * ddelta
                dbeta[b, t, h] = ddelta @ (v[b, t, h] - kv)
                dkv = -beta[b, t, h] * ddelta  # kv = S1^T k
                dkn[b, t, kh] += S1 @ dkv
                dS = dS + np.outer(kn[b, t, kh], dkv)
                dg[b, t, h] = np.sum(dS * S1)  # S1 = exp(g) S
                dS = dS * np.exp(g[b, t, h])
                if first[b, t]:  # the state before a sample's first token is not used
                    dS = np.zeros_like(dS)
            if dstate_in is not None:
                dstate_in[b, h] = dS
    for dx, x, dxn, r, c in ((dq, q, dqn, rq, scale), (dk, k, dkn, rk, 1)):
        dx[...] = dxn * r[..., None]
        if l2norm:
            dx -= x * (r ** 3 / (c * c) * np.sum(x * dxn, axis=-1))[..., None]
