"""The gates of the gated delta rule (Qwen3.5, Qwen3-Next): the decay g and the write
strength beta of each value head and token, from the layer's in_proj_a / in_proj_b
outputs, forward and backward (numba CPU kernels + numpy references).

    g = a * softplus(alpha + dt_bias),   beta = sigmoid(b)

with a = -exp(A_log) < 0 per head, so g <= 0. This is HF transformers'
`g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)` and
`beta = b.sigmoid()` (modeling_qwen3_5.py, Qwen3_5GatedDeltaNet), and llama.cpp's
ggml_softplus(alpha + ssm_dt) * ssm_a and ggml_sigmoid(beta) (src/models/qwen35.cpp),
whose GGUF stores a itself (ssm_a = -exp(A_log)) and dt_bias as ssm_dt. softplus(x)
is x above 20, as ggml's op_softplus and torch's default threshold.

Shapes: rows (N, H) of N tokens and H value heads; a, dt_bias (H,).
Backward: dalpha = dg a softplus'(x) (sigmoid(x), 1 above 20), db = dbeta beta (1 - beta),
overwritten; da += sum_rows(dg softplus(x)) and ddt_bias += sum_rows(dalpha) when given
(the base model's A_log and dt_bias are frozen in LoRA training: None skips them).
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array

_THRESHOLD = 20.0  # softplus(x) = x above it


@njit(inline="always")
def _softplus(x):
    return x if x > _THRESHOLD else np.log1p(np.exp(x))


@njit(cache=True, parallel=True)
def _gates_forward_kernel(g, beta, alpha, b, a, dt_bias):
    N, H = alpha.shape
    for n in prange(N):
        for h in range(H):
            g[n, h] = a[h] * _softplus(alpha[n, h] + dt_bias[h])
            beta[n, h] = 1 / (1 + np.exp(-b[n, h]))


@njit(cache=True, parallel=True)
def _gates_backward_kernel(dalpha, db, dg, dbeta, alpha, b, a, dt_bias):
    N, H = alpha.shape
    for n in prange(N):
        for h in range(H):
            x = alpha[n, h] + dt_bias[h]
            dsp = 1.0 if x > _THRESHOLD else 1 / (1 + np.exp(-x))
            dalpha[n, h] = dg[n, h] * a[h] * dsp
            s = 1 / (1 + np.exp(-b[n, h]))
            db[n, h] = dbeta[n, h] * s * (1 - s)


@njit(cache=True)
def _gates_param_kernel(da, ddt_bias, dg, dalpha, alpha, dt_bias):
    # da, ddt_bias (H,) += float64 sums over the rows, in row order
    N, H = alpha.shape
    for h in range(H):
        sa, sd = 0.0, 0.0
        for n in range(N):
            sa += dg[n, h] * _softplus(alpha[n, h] + dt_bias[h])
            sd += dalpha[n, h]
        da[h] += sa
        ddt_bias[h] += sd


def _check(arrays, rows, heads, optional=()):
    """Every array of `rows` (N, H) and `heads` (H,) checked, those in `optional` may be None."""
    x = arrays[rows[0]]
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"deltanet_gates: {rows[0]} must be a 2-D float32 or float64 array (N, H)")
    N, H = x.shape
    for name in rows:
        check_array("deltanet_gates", name, arrays[name], (N, H), x.dtype)
    for name in heads:
        if not (name in optional and arrays[name] is None):
            check_array("deltanet_gates", name, arrays[name], (H,), x.dtype)


def deltanet_gates_forward(g, beta, alpha, b, a, dt_bias):
    """g, beta (N, H) out; alpha, b (N, H) the in_proj_a / in_proj_b outputs; a (H,) =
    -exp(A_log); dt_bias (H,)."""
    _check(dict(alpha=alpha, b=b, g=g, beta=beta, a=a, dt_bias=dt_bias),
           ("alpha", "b", "g", "beta"), ("a", "dt_bias"))
    _gates_forward_kernel(g, beta, alpha, b, a, dt_bias)


def deltanet_gates_backward(dalpha, db, da, ddt_bias, dg, dbeta, alpha, b, a, dt_bias):
    """dalpha, db (N, H) overwritten; da, ddt_bias: None or (H,), accumulated; dg, dbeta
    (N, H) the gradients of g and beta; the forward's inputs."""
    arrays = dict(alpha=alpha, b=b, dalpha=dalpha, db=db, dg=dg, dbeta=dbeta, a=a, dt_bias=dt_bias,
                  da=da, ddt_bias=ddt_bias)
    _check(arrays, ("alpha", "b", "dalpha", "db", "dg", "dbeta"), ("a", "dt_bias", "da", "ddt_bias"),
           optional=("da", "ddt_bias"))
    if (da is None) != (ddt_bias is None):
        raise ValueError("deltanet_gates: da and ddt_bias go together (both None or both arrays)")
    _gates_backward_kernel(dalpha, db, dg, dbeta, alpha, b, a, dt_bias)
    if da is not None:
        _gates_param_kernel(da, ddt_bias, dg, dalpha, alpha, dt_bias)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def _softplus_ref(x):
    return np.where(x > _THRESHOLD, x, np.log1p(np.exp(np.minimum(x, _THRESHOLD))))


def deltanet_gates_forward_ref(g, beta, alpha, b, a, dt_bias):
    g[...] = a * _softplus_ref(alpha + dt_bias)
    beta[...] = 1 / (1 + np.exp(-b))


def deltanet_gates_backward_ref(dalpha, db, da, ddt_bias, dg, dbeta, alpha, b, a, dt_bias):
    x = alpha + dt_bias
    dalpha[...] = dg * a * np.where(x > _THRESHOLD, 1.0, 1 / (1 + np.exp(-x)))
    s = 1 / (1 + np.exp(-b))
    db[...] = dbeta * s * (1 - s)
    if da is not None:
        da += np.sum((dg * _softplus_ref(x)).astype(np.float64), axis=0)
        ddt_bias += np.sum(dalpha.astype(np.float64), axis=0)
