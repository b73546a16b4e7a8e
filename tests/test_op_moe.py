"""moe (kernels/moe.py): the top-k softmax router and the grouped expert SwiGLU, numpy
references. The router's weights against their definition (and gpt-oss's softmax over
the top k logits), the grouped forward against a per-token loop, experts no token chose
left alone, and every backward (router logits, expert weights, x, the router weights,
the whole block through its router projection) against float64 finite differences with
the choice of experts held fixed (the logits' top k stay apart by far more than eps)."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F64, FD_TOL, randn

from llamatune.kernels.moe import (expert_groups, moe_ffn_backward_ref, moe_ffn_forward_ref,
                                   router_backward_ref, router_forward_ref)

N, C, F, E, K = 7, 6, 5, 8, 3


def separated_logits(rng, n=N, e=E):
    """(n, e) logits whose values in a row are at least 0.05 apart (a fixed top k under
    the checker's 1e-6 steps)."""
    base = np.arange(e) * 0.3
    return np.stack([rng.permutation(base) + rng.uniform(0, 0.05, e) for _ in range(n)])


def route(logits, normalize=True, k=K):
    idx, w, probs = np.zeros((len(logits), k), np.int64), np.zeros((len(logits), k)), np.zeros_like(logits)
    router_forward_ref(idx, w, probs, logits, normalize)
    return idx, w, probs


def experts(rng):
    return randn(rng, E, F, C, dtype=F64), randn(rng, E, F, C, dtype=F64), randn(rng, E, C, F, dtype=F64)


@pytest.mark.parametrize("normalize", [True, False])
def test_router_weights_are_the_top_k_probabilities(normalize):
    logits = separated_logits(np.random.default_rng(0))
    idx, w, probs = route(logits, normalize)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(probs, p, rtol=1e-12)
    want = np.argsort(-logits, axis=1)[:, :K]
    np.testing.assert_array_equal(idx, want)
    top = np.take_along_axis(p, want, 1)
    np.testing.assert_allclose(w, top / top.sum(1, keepdims=True) if normalize else top, rtol=1e-12)
    if normalize:   # gpt-oss: softmax over the k largest logits alone, the same weights
        z = np.take_along_axis(logits, want, 1)
        np.testing.assert_allclose(w, np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-12)


def test_router_ties_pick_the_lower_expert():
    idx, _, _ = route(np.array([[1.0, 2.0, 2.0, 0.0, 2.0, -1.0, 0.0, 0.0]]))
    np.testing.assert_array_equal(idx, [[1, 2, 4]])


@pytest.mark.parametrize("normalize", [True, False])
def test_router_backward_fd(normalize):
    rng = np.random.default_rng(1)
    logits, dw = separated_logits(rng), randn(rng, N, K, dtype=F64)
    idx, w, probs = route(logits, normalize)

    def loss(logits):
        i, w_, _ = route(logits, normalize)
        np.testing.assert_array_equal(i, idx)            # the choice never moves under the steps
        return np.sum(w_ * dw)

    dlogits = np.full_like(logits, np.nan)
    router_backward_ref(dlogits, dw, idx, w, probs, normalize)
    fd_check(loss, {"logits": logits}, {"logits": dlogits}, **FD_TOL)


def test_expert_groups_sort_pairs_by_expert():
    idx = np.array([[3, 0], [0, 5], [3, 1]])
    order, offsets = expert_groups(idx, 6)
    np.testing.assert_array_equal(offsets, [0, 2, 3, 3, 5, 5, 6])
    np.testing.assert_array_equal(order, [1, 2, 5, 0, 4, 3])      # pairs k t + s, stable within an expert
    np.testing.assert_array_equal(idx.reshape(-1)[order], [0, 0, 1, 3, 3, 5])


def test_grouped_forward_equals_a_per_token_loop():
    rng = np.random.default_rng(2)
    x = randn(rng, N, C, dtype=F64)
    idx, w, _ = route(separated_logits(rng))
    wg, wu, wd = experts(rng)
    out = np.full((N, C), np.nan)
    groups = moe_ffn_forward_ref(out, x, idx, w, wg, wu, wd)
    want = np.zeros((N, C))
    for t in range(N):
        for s in range(K):
            e = idx[t, s]
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            want[t] += w[t, s] * (wd[e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert [grp.expert for grp in groups] == sorted(set(idx.reshape(-1)))


def test_experts_no_token_chose_are_not_touched():
    """Tokens routed to experts 1, 4 and 6 only: the groups hold those three, and the
    weight gradients of the others stay as they were (NaN here: never read or written)."""
    rng = np.random.default_rng(3)
    x, dout = randn(rng, N, C, dtype=F64), randn(rng, N, C, dtype=F64)
    idx = np.array([[1, 4], [6, 1], [4, 6], [1, 6], [4, 1], [6, 4], [1, 4]])
    w = rng.uniform(0.1, 1, (N, 2))
    wg, wu, wd = experts(rng)
    groups = moe_ffn_forward_ref(np.zeros((N, C)), x, idx, w, wg, wu, wd)
    assert [g.expert for g in groups] == [1, 4, 6]
    used = [1, 4, 6]
    dws = [np.full(a.shape, np.nan) for a in (wg, wu, wd)]
    for d in dws:
        d[used] = 0
    moe_ffn_backward_ref(np.zeros((N, C)), np.zeros((N, 2)), *dws, dout, x, w, wg, wu, wd, groups)
    for d in dws:
        assert np.isfinite(d[used]).all() and np.isnan(np.delete(d, used, axis=0)).all()


def test_expert_ffn_backward_fd():
    """dx, the router weights' gradient dw and the expert weights' (accumulated onto what
    they held) against finite differences of L = sum(out * dout), idx fixed."""
    rng = np.random.default_rng(4)
    x, dout = randn(rng, N, C, dtype=F64), randn(rng, N, C, dtype=F64)
    idx, w, _ = route(separated_logits(rng))
    w = np.ascontiguousarray(w)
    wg, wu, wd = experts(rng)
    out = np.zeros((N, C))

    def loss(x, w, wg, wu, wd):
        moe_ffn_forward_ref(out, x, idx, w, wg, wu, wd)
        return np.sum(out * dout)

    groups = moe_ffn_forward_ref(out, x, idx, w, wg, wu, wd)
    dx, dw = np.full((N, C), np.nan), np.full((N, K), np.nan)
    held = [randn(rng, *a.shape, dtype=F64) for a in (wg, wu, wd)]          # accumulated onto
    dws = [h.copy() for h in held]
    moe_ffn_backward_ref(dx, dw, *dws, dout, x, w, wg, wu, wd, groups)
    grads = {"x": dx, "w": dw, "wg": dws[0] - held[0], "wu": dws[1] - held[1], "wd": dws[2] - held[2]}
    fd_check(loss, {"x": x, "w": w, "wg": wg, "wu": wu, "wd": wd}, grads, **FD_TOL)
    dx_frozen, dw_frozen = np.zeros((N, C)), np.zeros((N, K))                # frozen experts: None
    moe_ffn_backward_ref(dx_frozen, dw_frozen, None, None, None, dout, x, w, wg, wu, wd, groups)
    np.testing.assert_array_equal(dx_frozen, dx)
    np.testing.assert_array_equal(dw_frozen, dw)


def test_moe_block_backward_through_the_router_fd():
    """The whole block, logits = x W_r^T, top-k normalized router, grouped experts: dx
    (the experts' inputs and the router's) and dW_r against finite differences."""
    rng = np.random.default_rng(5)
    x, dout = randn(rng, N, C, dtype=F64), randn(rng, N, C, dtype=F64)
    wr = randn(rng, E, C, dtype=F64)
    wg, wu, wd = experts(rng)
    idx0, _, _ = route(x @ wr.T)
    p = np.sort(x @ wr.T, axis=1)
    assert (p[:, -K] - p[:, -K - 1]).min() > 1e-4       # a fixed top k under the 1e-6 steps
    out = np.zeros((N, C))

    def loss(x, wr):
        idx, w, _ = route(x @ wr.T)
        np.testing.assert_array_equal(idx, idx0)
        moe_ffn_forward_ref(out, x, idx, w, wg, wu, wd)
        return np.sum(out * dout)

    logits = x @ wr.T
    idx, w, probs = route(logits)
    groups = moe_ffn_forward_ref(out, x, idx, w, wg, wu, wd)
    dx, dw = np.zeros((N, C)), np.zeros((N, K))
    moe_ffn_backward_ref(dx, dw, None, None, None, dout, x, w, wg, wu, wd, groups)
    dlogits = np.zeros_like(logits)
    router_backward_ref(dlogits, dw, idx, w, probs)
    fd_check(loss, {"x": x, "wr": wr}, {"x": dx + dlogits @ wr, "wr": dlogits.T @ x}, **FD_TOL)
