"""moe (kernels/moe.py): the numba router and grouped expert SwiGLU against the numpy
references: the router's choice equal and its weights and backward within float32
rounding, the counting sort equal to the reference's stable sort, the expert FFN
forward and backward within float32 rounding (and to 1e-12 run in float64), LoRA on the
experts (llama.cpp's build_lora_mm_id layout) equal to the reference with the folded
weights W + scale B A, and its backward (x, router weights, A, B) against float64
finite differences."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F32, F64, FD_TOL, randn
from test_op_moe import E, K, N, C, F, experts, route, separated_logits

from llamatune.kernels.moe import (ExpertLora, expert_groups, expert_order, moe_ffn_backward,
                                   moe_ffn_backward_ref, moe_ffn_forward, moe_ffn_forward_ref,
                                   router_backward, router_backward_ref, router_forward)

R = 3   # LoRA rank


@pytest.mark.parametrize("normalize", [True, False])
def test_router_matches_reference(normalize):
    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((64, 32)) * 2).astype(F32)
    idx, w, probs = route(logits.astype(F64), normalize, k=4)
    idx32, w32, p32 = np.zeros((64, 4), np.int64), np.zeros((64, 4), F32), np.zeros((64, 32), F32)
    router_forward(idx32, w32, p32, logits, normalize)
    np.testing.assert_array_equal(idx32, idx)
    np.testing.assert_allclose(p32, probs, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(w32, w, rtol=2e-6)
    dw = rng.standard_normal((64, 4)).astype(F32)
    want = np.zeros((64, 32))
    router_backward_ref(want, dw.astype(F64), idx, w, probs, normalize)
    got = np.full((64, 32), np.nan, F32)
    router_backward(got, dw, idx32, w32, p32, normalize)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_router_ties_pick_the_lower_expert():
    logits = np.array([[1.0, 2.0, 2.0, 0.0, 2.0, -1.0, 0.0, 0.0]], F32)
    idx, w, p = np.zeros((1, 3), np.int64), np.zeros((1, 3), F32), np.zeros((1, 8), F32)
    router_forward(idx, w, p, logits)
    np.testing.assert_array_equal(idx, [[1, 2, 4]])


def test_counting_sort_equals_the_stable_sort():
    rng = np.random.default_rng(11)
    for n, e, k in ((1, 4, 1), (37, 16, 4), (512, 128, 8)):
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
        order, offsets, pos = expert_order(idx, e)
        want_order, want_offsets = expert_groups(idx, e)
        np.testing.assert_array_equal(order, want_order)
        np.testing.assert_array_equal(offsets, want_offsets)
        np.testing.assert_array_equal(pos[order], np.arange(n * k))
    with pytest.raises(ValueError, match=r"expert index out of range \[0, 4\)"):
        expert_order(np.array([[0, 4]]), 4)


def _case(dtype, seed=12, n=N, e=E, k=K, unused=()):
    rng = np.random.default_rng(seed)
    x, dout = randn(rng, n, C, dtype=dtype), randn(rng, n, C, dtype=dtype)
    logits = separated_logits(rng, n, e)
    logits[:, list(unused)] = -100                              # experts no token chooses
    idx, w, _ = route(logits, k=k)
    wg, wu, wd = (a.astype(dtype) for a in experts(rng))
    return x, dout, idx, np.ascontiguousarray(w, dtype), wg, wu, wd


@pytest.mark.parametrize("dtype,tol", [(F32, 1e-5), (F64, 1e-12)], ids=["f32", "f64"])
def test_expert_ffn_matches_reference(dtype, tol):
    """Forward, dx, dw and the expert weights' gradients (accumulated onto what they held;
    experts no token chose untouched) against the reference in float64."""
    x, dout, idx, w, wg, wu, wd = _case(dtype, unused=[2])
    assert 2 not in idx
    f64 = [a.astype(F64) for a in (x, dout, w, wg, wu, wd)]
    want = np.zeros((N, C))
    groups = moe_ffn_forward_ref(want, f64[0], idx, f64[2], *f64[3:])
    out = np.full((N, C), np.nan, dtype)
    rows = moe_ffn_forward(out, x, idx, w, wg, wu, wd)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    dx, dw = np.zeros((N, C)), np.zeros((N, K))
    dws = [np.ones_like(a, F64) for a in (wg, wu, wd)]
    moe_ffn_backward_ref(dx, dw, *dws, f64[1], f64[0], f64[2], *f64[3:], groups)
    got = [np.full((N, C), np.nan, dtype), np.full((N, K), np.nan, dtype)] + [np.ones_like(a) for a in (wg, wu, wd)]
    moe_ffn_backward(*got, dout, x, w, wg, wu, wd, rows)
    for g, want_g in zip(got, [dx, dw, *dws]):
        np.testing.assert_allclose(g, want_g, rtol=tol, atol=tol)
    for d in got[2:]:
        np.testing.assert_array_equal(d[2], 1)


def _loras(rng, dtype, scale=0.7):
    return {name: ExpertLora(0.3 * randn(rng, E, R, n_in, dtype=dtype), 0.3 * randn(rng, E, n_out, R, dtype=dtype), scale,
                             np.zeros((E, R, n_in), dtype), np.zeros((E, n_out, R), dtype))
            for name, n_in, n_out in (("gate", C, F), ("up", C, F), ("down", F, C))}


def test_expert_lora_equals_folded_weights():
    """LoRA on the experts = the reference with W[e] + scale B[e] A[e]; dA = scale B^T dW,
    dB = scale dW A^T of the folded weights' gradient dW."""
    x, dout, idx, w, wg, wu, wd = _case(F64, seed=13)
    lora = _loras(np.random.default_rng(14), F64)
    folded = [base + lo.scale * lo.b @ lo.a for base, lo in zip((wg, wu, wd), lora.values())]
    want, out = np.zeros((N, C)), np.zeros((N, C))
    groups = moe_ffn_forward_ref(want, x, idx, w, *folded)
    rows = moe_ffn_forward(out, x, idx, w, wg, wu, wd, lora)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    dx, dw, dws = np.zeros((N, C)), np.zeros((N, K)), [np.zeros_like(a) for a in folded]
    moe_ffn_backward_ref(dx, dw, *dws, dout, x, w, *folded, groups)
    gx, gw = np.zeros((N, C)), np.zeros((N, K))
    moe_ffn_backward(gx, gw, None, None, None, dout, x, w, wg, wu, wd, rows, lora)
    np.testing.assert_allclose(gx, dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gw, dw, rtol=1e-12, atol=1e-12)
    for lo, d in zip(lora.values(), dws):
        np.testing.assert_allclose(lo.da, lo.scale * lo.b.transpose(0, 2, 1) @ d, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lo.db, lo.scale * d @ lo.a.transpose(0, 2, 1), rtol=1e-12, atol=1e-12)


def test_expert_lora_backward_fd():
    """The numba path run in float64: dx, dw and every expert's A and B against finite
    differences of L = sum(out * dout), idx fixed."""
    x, dout, idx, w, wg, wu, wd = _case(F64, seed=15)
    lora = _loras(np.random.default_rng(16), F64)
    out = np.zeros((N, C))
    inputs = {"x": x, "w": w, **{f"a_{n}": lo.a for n, lo in lora.items()}, **{f"b_{n}": lo.b for n, lo in lora.items()}}

    def loss(**_):
        moe_ffn_forward(out, x, idx, w, wg, wu, wd, lora)
        return np.sum(out * dout)

    rows = moe_ffn_forward(out, x, idx, w, wg, wu, wd, lora)
    dx, dw = np.zeros((N, C)), np.zeros((N, K))
    moe_ffn_backward(dx, dw, None, None, None, dout, x, w, wg, wu, wd, rows, lora)
    grads = {"x": dx, "w": dw, **{f"a_{n}": lo.da for n, lo in lora.items()}, **{f"b_{n}": lo.db for n, lo in lora.items()}}
    fd_check(loss, inputs, grads, **FD_TOL)


class _NoExperts:
    """A down tensor that must not be read (a recompute without output)."""
    shape = (E, C, F)

    def __getitem__(self, e):
        raise AssertionError("the down experts were read")


def test_forward_without_output_keeps_what_backward_reads():
    """output=False (a recompute whose output nobody reads): out zeroed, the down experts
    not read, and the backward from its rows gives the same gradients, bit for bit, as
    from a forward with output."""
    x, dout, idx, w, wg, wu, wd = _case(F32, seed=17)
    grads = []
    for output in (True, False):
        lora = _loras(np.random.default_rng(18), F32)
        out = np.full((N, C), np.nan, F32)
        rows = moe_ffn_forward(out, x, idx, w, wg, wu, wd if output else _NoExperts(), lora, output=output)
        if not output:
            np.testing.assert_array_equal(out, 0)
        dx, dw = np.zeros((N, C), F32), np.zeros((N, K), F32)
        moe_ffn_backward(dx, dw, None, None, None, dout, x, w, wg, wu, wd, rows, lora)
        grads.append([dx, dw] + [g for lo in lora.values() for g in (lo.da, lo.db)])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_bf16_rows_rounded_once_equal_rounded_per_expert():
    """bf16 products over each projection's rows rounded once (row_padded's operand:
    Products.rounded) give the forward and backward of rounding each expert's rows apart,
    bit for bit."""
    from llamatune.kernels import bf16
    from llamatune.kernels.moe import row_padded
    from llamatune.models.products import Products
    from llamatune.precision import policy
    if not (bf16.cpu_bf16_flags() and bf16.available()):
        pytest.skip("this CPU has no native bf16 or oneDNN is not installed")
    x, dout, idx, w, wg, wu, wd = _case(F32, seed=19)
    experts = []
    for a in (wg, wu, wd):
        bits = np.empty(a.shape, np.uint16)
        bf16.to_bf16(bits.reshape(-1, a.shape[-1]), a.reshape(-1, a.shape[-1]))
        experts.append(bits)
    got = []
    for once in (False, True):
        products = Products(np, policy("bf16"))
        mm = row_padded(products, operand=products.rounded if once else None)
        lora = _loras(np.random.default_rng(20), F32)
        out = np.empty((N, C), F32)
        rows = moe_ffn_forward(out, x, idx, w, *experts, lora, mm=mm)
        dx, dw = np.zeros((N, C), F32), np.zeros((N, K), F32)
        moe_ffn_backward(dx, dw, None, None, None, dout, x, w, *experts, rows, lora, mm=mm)
        got.append([out, dx, dw] + [g for lo in lora.values() for g in (lo.da, lo.db)])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
