"""The one finite-difference gradient checker, for single kernels and the whole model.

    fd_check(f, inputs, analytic)  asserts  analytic[name] == dL/d inputs[name]

where L = f(**inputs) is a float64 scalar (typically sum(out * dout) for a fixed
random dout) and analytic holds the backward's gradients. Each checked element is
perturbed in place by +-eps and restored: dL/dx ~ (L(x+eps) - L(x-eps)) / (2 eps).
All inputs must be float64 so that central differences are accurate to ~1e-9.
"""

import numpy as np


def fd_check(f, inputs, analytic, eps=1e-6, rtol=1e-6, atol=1e-9, n_probe=None, seed=0):
    """Check analytic gradients against central differences; return the max relative error.

    f: callable, f(**inputs) -> scalar loss (computed in float64).
    inputs: name -> array; the arrays named in `analytic` are perturbed in place
        (and restored), so they must be C-contiguous float64; others pass through.
    analytic: name -> dL/d inputs[name], same shape.
    n_probe: None checks every element; otherwise n_probe random elements per input
        (chosen with numpy.random.default_rng(seed)).
    rtol, atol: tolerances of np.testing.assert_allclose(analytic, numeric) over the
        whole checked gradient (not a mean); rtol must be > 0.
    Returns the max over checked elements of |a - n| / (|n| + atol/rtol): the relative
    error with gradients below atol/rtol weighed as absolute; the assertion holds
    exactly when this is <= rtol.
    """
    if not rtol > 0:
        raise ValueError(f"fd_check: rtol must be > 0, got {rtol}")
    rng = np.random.default_rng(seed)
    worst = 0.0
    for name, grad in analytic.items():
        x = inputs[name]
        if x.dtype != np.float64 or not x.flags.c_contiguous:
            raise ValueError(f"fd_check: input {name!r} must be a C-contiguous float64 array")
        if grad.shape != x.shape:
            raise ValueError(f"fd_check: gradient {name!r} has shape {grad.shape}, "
                             f"input has {x.shape}")
        flat = x.reshape(-1)  # a view: writing it perturbs inputs[name]
        if n_probe is None or n_probe >= flat.size:
            idx = np.arange(flat.size)
        else:
            idx = np.sort(rng.choice(flat.size, size=n_probe, replace=False))
        numeric = np.empty(len(idx))
        for k, i in enumerate(idx):
            old = flat[i]
            flat[i] = old + eps
            l_plus = float(f(**inputs))
            flat[i] = old - eps
            l_minus = float(f(**inputs))
            flat[i] = old
            numeric[k] = (l_plus - l_minus) / (2.0 * eps)
        a = np.asarray(grad, dtype=np.float64).reshape(-1)[idx]
        np.testing.assert_allclose(a, numeric, rtol=rtol, atol=atol,
                                   err_msg=f"fd_check: gradient of {name!r}")
        rel = np.abs(a - numeric) / (np.abs(numeric) + atol / rtol)
        worst = max(worst, float(rel.max(initial=0.0)))
    return worst
