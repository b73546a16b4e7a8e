"""Cross-check of the gated delta-net kernels against HF transformers' own code
(modeling_qwen3_5.py), outputs and autograd gradients, in float64.

    python -m checks.deltanet_hf --torch-python PATH [--T 150] [--tol 1e-9]

PATH is a Python interpreter with torch and transformers (>= the release with
qwen3_5); this repository's environment needs neither. The same file runs twice:
here it draws random inputs and runs the kernels; under PATH (`--hf-side`) it runs
HF's `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`, `Qwen3_5RMSNormGated` and the layer's gate expressions, and
torch.autograd for the gradients of sum(out * dout) (+ sum(state * dstate)). HF's
delta-rule functions and gated norm cast to float32; the check runs their source with
those casts made float64 (inspect + exec in the module's namespace), so both sides
agree to rounding; the gates are the layer's two lines without their .float() casts.
Prints the largest relative difference per tensor; exits 1 when one exceeds --tol.
Measured: every tensor within 9.4e-16 (the default T = 150: two chunks of 64 and a
partial one).

The kernels are called with HF's conventions: l2norm on, scale 1/sqrt(DK), grouped
heads (value head h reads q/k head h // (NV / NK), HF's repeat_interleave).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPE = dict(B=2, NK=2, NV=4, DK=16, DV=8, K=4)  # the conv runs over 2 NK DK + NV DV channels


def _inputs(T: int, seed: int = 0) -> dict:
    """Random float64 inputs of every op (the models' ranges: g <= 0, beta in (0, 1))."""
    rng = np.random.default_rng(seed)
    B, NK, NV, DK, DV, K = (SHAPE[n] for n in ("B", "NK", "NV", "DK", "DV", "K"))
    C = 2 * NK * DK + NV * DV
    r = rng.standard_normal
    return dict(
        q=r((B, T, NK, DK)), k=r((B, T, NK, DK)), v=r((B, T, NV, DV)),
        g=-np.log1p(np.exp(r((B, T, NV)))), beta=1 / (1 + np.exp(-r((B, T, NV)))),
        state=r((B, NV, DK, DV)), dout=r((B, T, NV, DV)), dstate=r((B, NV, DK, DV)),
        x=r((B, T, C)), w=0.5 * r((C, K)), dconv=r((B, T, C)),
        o=r((B * T * NV, DV)), z=2 * r((B * T * NV, DV)), nw=1 + 0.3 * r(DV), dnorm=r((B * T * NV, DV)),
        alpha=3 * r((B * T, NV)), b=3 * r((B * T, NV)), A_log=r(NV), dt_bias=r(NV),
        dg=r((B * T, NV)), dbeta=r((B * T, NV)))


def _kernels(a: dict) -> dict:
    """The kernels' outputs and gradients, named as _hf_side names HF's."""
    import llamatune  # noqa: F401  (threading policy first)
    from llamatune.kernels import causal_conv, deltanet, deltanet_gates, gated_norm

    res = {}
    q, k, v, g, beta, s0 = (a[n] for n in ("q", "k", "v", "g", "beta", "state"))
    out, s1 = np.zeros_like(v), np.zeros_like(s0)
    deltanet.deltanet_forward(out, s1, q, k, v, g, beta, s0)
    res["rule_out"], res["rule_state"] = out, s1
    dec_out, dec_state = np.zeros_like(v), s0.copy()
    deltanet.deltanet_decode(dec_out, dec_state, q, k, v, g, beta)
    res["recurrent_out"], res["recurrent_state"] = dec_out, dec_state
    grads = [np.zeros_like(x) for x in (q, k, v, g, beta, s0)]
    deltanet.deltanet_backward(*grads, a["dout"], q, k, v, g, beta, s0, a["dstate"])
    for n, x in zip(("q", "k", "v", "g", "beta", "state"), grads):
        res["rule_d" + n] = x
    x, w = a["x"], a["w"]
    res["conv_out"] = np.zeros_like(x)
    causal_conv.causal_conv_forward(res["conv_out"], x, w)
    res["conv_dx"], res["conv_dw"] = np.zeros_like(x), np.zeros_like(w)
    causal_conv.causal_conv_backward(res["conv_dx"], res["conv_dw"], a["dconv"], x, w)
    o, z, nw = a["o"], a["z"], a["nw"]
    res["norm_out"], rstd = np.zeros_like(o), np.zeros(len(o))
    gated_norm.gated_rmsnorm_forward(res["norm_out"], rstd, o, z, nw, 1e-6)
    res["norm_dx"], res["norm_dz"], res["norm_dw"] = np.zeros_like(o), np.zeros_like(z), np.zeros_like(nw)
    gated_norm.gated_rmsnorm_backward(res["norm_dx"], res["norm_dz"], res["norm_dw"], a["dnorm"], o, z, nw,
                                      rstd)
    res.update(_gates(a, deltanet_gates))
    return res


def _gates(a: dict, deltanet_gates) -> dict:
    alpha, b = a["alpha"], a["b"]
    neg_a = -np.exp(a["A_log"])
    g, beta = np.zeros_like(alpha), np.zeros_like(b)
    deltanet_gates.deltanet_gates_forward(g, beta, alpha, b, neg_a, a["dt_bias"])
    dalpha, db, da, ddt = np.zeros_like(alpha), np.zeros_like(b), np.zeros_like(neg_a), np.zeros_like(neg_a)
    deltanet_gates.deltanet_gates_backward(dalpha, db, da, ddt, a["dg"], a["dbeta"], alpha, b, neg_a,
                                           a["dt_bias"])
    # HF's parameter is A_log: dA_log = da * d(-exp(A_log))/dA_log = da * a
    return dict(gates_g=g, gates_beta=beta, gates_dalpha=dalpha, gates_db=db, gates_dA_log=da * neg_a,
                gates_ddt_bias=ddt)


def _hf_side(inp: str, outp: str) -> None:
    """Under the torch interpreter: HF's functions on the inputs, outputs and gradients."""
    import inspect

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    def float64_version(fn):
        src = inspect.getsource(inspect.unwrap(fn))
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("@"))
        ns = dict(vars(m))
        exec(src.replace("torch.float32", "torch.float64"), ns)  # noqa: S102  (HF's own source)
        return ns[fn.__name__]

    chunk = float64_version(m.torch_chunk_gated_delta_rule)
    recurrent = float64_version(m.torch_recurrent_gated_delta_rule)
    norm_class = float64_version(m.Qwen3_5RMSNormGated)
    a = {n: torch.tensor(x, dtype=torch.float64) for n, x in np.load(inp).items()}
    res = {}
    leaves = {n: a[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "state")}
    out, state = chunk(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves["state"],
                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    (torch.sum(out * a["dout"]) + torch.sum(state * a["dstate"])).backward()
    res["rule_out"], res["rule_state"] = out, state
    res.update({"rule_d" + n: t.grad for n, t in leaves.items()})
    with torch.no_grad():
        res["recurrent_out"], res["recurrent_state"] = recurrent(
            a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["state"], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    x, w = a["x"].clone().requires_grad_(), a["w"].clone().requires_grad_()
    conv = m.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.sum(conv * a["dconv"]).backward()
    res.update(conv_out=conv, conv_dx=x.grad, conv_dw=w.grad)
    norm = norm_class(a["o"].shape[1], eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(a["nw"])
    o, z = a["o"].clone().requires_grad_(), a["z"].clone().requires_grad_()
    y = norm(o, z)
    torch.sum(y * a["dnorm"]).backward()
    res.update(norm_out=y, norm_dx=o.grad, norm_dz=z.grad, norm_dw=norm.weight.grad)
    res.update(_hf_gates(a, torch))
    np.savez(outp, **{n: t.detach().numpy() for n, t in res.items()})


def _hf_gates(a: dict, torch) -> dict:
    import torch.nn.functional as F

    leaves = {n: a[n].clone().requires_grad_() for n in ("alpha", "b", "A_log", "dt_bias")}
    # Qwen3_5GatedDeltaNet.forward's two lines, without the .float() casts of A_log and a
    beta = leaves["b"].sigmoid()
    g = -leaves["A_log"].exp() * F.softplus(leaves["alpha"] + leaves["dt_bias"])
    (torch.sum(g * a["dg"]) + torch.sum(beta * a["dbeta"])).backward()
    return dict(gates_g=g, gates_beta=beta, gates_dalpha=leaves["alpha"].grad, gates_db=leaves["b"].grad,
                gates_dA_log=leaves["A_log"].grad, gates_ddt_bias=leaves["dt_bias"].grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-python", help="an interpreter with torch and transformers")
    ap.add_argument("--T", type=int, default=150, help="tokens (150: two chunks of 64 and a partial one)")
    ap.add_argument("--tol", type=float, default=1e-9, help="largest relative difference allowed")
    ap.add_argument("--hf-side", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_side:
        _hf_side(*args.hf_side)
        return
    if not args.torch_python:
        sys.exit("deltanet_hf: --torch-python is needed (an interpreter with torch and transformers)")
    a = _inputs(args.T)
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(inp, **a)
        run = subprocess.run([args.torch_python, __file__, "--hf-side", str(inp), str(outp)],
                             capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"deltanet_hf: the HF side failed:\n{run.stderr[-3000:]}")
        hf = dict(np.load(outp))
    mine = _kernels(a)
    worst = 0.0
    for name, want in hf.items():
        got = mine[name]
        rel = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))
        worst = max(worst, rel)
        print(f"{name:16s} {str(want.shape):18s} max |diff| / max |HF| = {rel:.2e}")
    print(f"worst {worst:.2e} (tolerance {args.tol:.0e})")
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
