"""The mixture-of-experts feed-forward of a layer, backward (models/moe.py runs its
forward): the gradient into the layer's normed input through the experts each token
chose and through the router, with the choice of experts held fixed, as HF's autograd
takes it through torch.topk's values:

    dw[t, j] = dout[t] . SwiGLU_e(xn[t]),  dxn = sum_j w[t, j] dSwiGLU_e     (kernels/moe.py)
    dz = softmax backward of the normalized top-k weights               (the router's logits)
    dxn += dz W_router;  the router's adapter (if any) gets its gradient from dz

The expert weights are frozen; their adapters (per expert A, B: models/moe.py) get their
gradients here, and each chosen expert is dequantized again, one at a time, as the
forward did.
"""
from __future__ import annotations

import numpy as np

from ..kernels import moe as kmoe
from ..models.moe import PROJECTIONS, MoeActs, experts_of


def router_backward(dlogits: np.ndarray, dw: np.ndarray, acts: MoeActs, normalize: bool) -> None:
    """dlogits (N, E) = dL/dz from dw (N, k) = dL/dw (overwritten): numba in float32, the
    reference in float64."""
    if dlogits.dtype == np.float32:
        kmoe.router_backward(dlogits, dw, acts.idx, acts.w, acts.probs, normalize)
    else:
        kmoe.router_backward_ref(dlogits, dw, acts.idx, acts.w, acts.probs, normalize)


def trained_expert_adapters(executor, i: int) -> dict[str, kmoe.ExpertLora]:
    """The training graph's adapters on layer i's experts with their gradients (da, db
    accumulated by the expert kernels' backward)."""
    out = {}
    for proj, kind in PROJECTIONS:
        t = executor.linears.adapter(f"blk.{i}.{kind}.weight")
        if t is not None:
            out[proj] = kmoe.ExpertLora(t.a, t.b, t.scale, t.da, t.db)
    return out


def moe_backward(executor, dxn: np.ndarray, dout: np.ndarray, xn: np.ndarray, acts: MoeActs, i: int) -> None:
    """dxn (N, C) = dL/dxn of layer i's mixture of experts (overwritten), from dout (N, C) =
    dL/d(its output); xn the forward's input. `graph` is the training graph (its
    linears.backward takes the router's product and adapter)."""
    dw = np.empty_like(acts.w)
    kmoe.moe_ffn_backward(dxn, dw, None, None, None, dout, xn, acts.w, *experts_of(executor.weights, i), acts.rows,
                          lora=trained_expert_adapters(executor, i))
    dlogits = np.empty_like(acts.probs)
    router_backward(dlogits, dw, acts, executor.cfg.spec.expert_norm)
    executor.linears.backward(dxn, dlogits, xn, f"blk.{i}.ffn_gate_inp.weight", accumulate=True)
