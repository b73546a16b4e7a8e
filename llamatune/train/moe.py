"""The mixture-of-experts feed-forward of a layer, backward (models/moe.py runs its
forward): the gradient into the layer's normed input through the experts each token
chose and through the router, with the choice of experts held fixed, as HF's autograd
takes it through torch.topk's values:

    dw[t, j] = dout[t] . SwiGLU_e(xn[t]),  dxn = sum_j w[t, j] dSwiGLU_e     (kernels/moe.py)
    dz = softmax backward of the normalized top-k weights               (the router's logits)
    dxn += dz W_router;  the router's adapter (if any) gets its gradient from dz

With --router-aux-loss-coef, Hugging Face's load-balancing loss over every layer's
router (`load_balancing`) adds its gradient to the router's logits here.

The expert weights are frozen; their adapters (per expert A, B: models/moe.py) get their
gradients here, and each chosen expert is dequantized again, one at a time, as the
forward did, and multiplied as the forward's products (models/moe.expert_products).
"""
from __future__ import annotations

import numpy as np

from ..kernels import moe as kmoe
from ..models.moe import PROJECTIONS, MoeActs, expert_biases, expert_gate, expert_products, experts_of


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


def load_balancing(states: list[MoeActs], n_expert: int) -> tuple[float, np.ndarray]:
    """(aux, dp): transformers' load_balancing_loss_func (Switch Transformer eqs. 4-6, as
    Qwen3MoeForCausalLM adds it, attention mask None) over the routers of L layers of N
    tokens each, and its gradient with respect to every router probability:

        f_e = c_e / (L N)              c_e: the top-k choices of expert e, all layers
        P_e = sum_{l,t} p[l, t, e] / (L N)
        aux = E sum_e f_e P_e;         dp[e] = d aux / d p[l, t, e] = E c_e / (L N)^2

    The choice (f) passes no gradient, as torch.topk's indices and histc pass none."""
    rows = len(states) * states[0].idx.shape[0]
    counts = sum(np.bincount(s.idx.reshape(-1), minlength=n_expert) for s in states)
    prob_sum = sum(s.prob_sum.astype(np.float64) for s in states)
    f = counts / rows
    return n_expert * float(f @ (prob_sum / rows)), n_expert * f / rows


def probs_backward(dlogits: np.ndarray, dp: np.ndarray, probs: np.ndarray) -> None:
    """dlogits (N, E) += the softmax's backward of dp (E,), the same gradient on every
    token's probabilities: p * (dp - p . dp)."""
    dp = dp.astype(probs.dtype)
    dlogits += probs * (dp[None, :] - (probs @ dp)[:, None])


def moe_backward(executor, dxn: np.ndarray, dout: np.ndarray, xn: np.ndarray, acts: MoeActs, i: int) -> None:
    """dxn (N, C) = dL/dxn of layer i's mixture of experts (overwritten), from dout (N, C) =
    dL/d(its output); xn the forward's input. `graph` is the training graph (its
    linears.backward takes the router's product and adapter; its router_aux_grad, (E,)
    or None, the load-balancing loss's dL/dp)."""
    dw = np.empty_like(acts.w)
    bf16, mm = expert_products(executor, xn.shape[0])
    kmoe.moe_ffn_backward(dxn, dw, None, None, None, dout, xn, acts.w, *experts_of(executor.weights, i, bf16), acts.rows,
                          lora=trained_expert_adapters(executor, i), mm=mm,
                          bias=expert_biases(executor.weights, i, xn.dtype), gate=expert_gate(executor.cfg))
    dlogits = np.empty_like(acts.probs)
    router_backward(dlogits, dw, acts, executor.cfg.spec.expert_norm)
    if executor.router_aux_grad is not None:
        probs_backward(dlogits, executor.router_aux_grad, acts.probs)
    executor.linears.backward(dxn, dlogits, xn, f"blk.{i}.ffn_gate_inp.weight", accumulate=True)


def warm_up_experts() -> None:
    """Run the router's and the experts' kernels once on tiny float32 arrays, LoRA
    included (compiling them, or loading them from numba's disk cache, and loading
    oneDNN for the per-expert products), so that the runtime the memory estimate
    measures holds them (train/step.compile_kernels)."""
    rng = np.random.default_rng(0)
    N, C, F, E, k, r = 4, 16, 8, 4, 2, 2
    f32 = np.float32
    x, logits = rng.standard_normal((N, C), f32), rng.standard_normal((N, E), f32)
    idx, w, probs = np.empty((N, k), np.int64), np.empty((N, k), f32), np.empty((N, E), f32)
    kmoe.router_forward(idx, w, probs, logits)
    experts = [rng.standard_normal(s, f32) for s in ((E, F, C), (E, F, C), (E, C, F))]
    lora = {p: kmoe.ExpertLora(np.zeros((E, r, n_in), f32), np.zeros((E, n_out, r), f32), 1.0,
                               np.zeros((E, r, n_in), f32), np.zeros((E, n_out, r), f32))
            for p, n_in, n_out in (("gate", C, F), ("up", C, F), ("down", F, C))}
    out, dx, dw = np.empty_like(x), np.empty_like(x), np.empty_like(w)
    rows = kmoe.moe_ffn_forward(out, x, idx, w, *experts, lora=lora)
    kmoe.moe_ffn_backward(dx, dw, None, None, None, out, x, w, *experts, rows, lora=lora)
    kmoe.router_backward(np.empty_like(logits), dw, idx, w, probs)
