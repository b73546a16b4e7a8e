"""The CUDA kernel package (llamatune.kernels.cuda) as a whole: importing it loads
nothing of numba.cuda, its NumPy compatibility alias, the simulator standing in
where no GPU is, and every kernel through numba-cuda's real compiler to PTX. Each
op's CUDA kernel is tested beside its CPU twin in tests/test_op_<op>.py.

Runs on a GPU when one is present, else under numba's CUDA simulator: when no
GPU is found (without importing numba.cuda) and NUMBA_ENABLE_CUDASIM is unset,
the module sets it before numba.cuda is imported.
"""
import numpy as np
import pytest
from conftest_cuda import cuda_or_skip

cuda = cuda_or_skip()

from llamatune.kernels import cuda as kc  # noqa: E402

pytestmark = pytest.mark.cuda


# ---------------------------------------------------------------------- setup
def test_package_imports_nothing_from_numba_cuda_until_used():
    import subprocess
    import sys
    code = ("import sys, llamatune.kernels.cuda as c; "
            "print(any(m == 'numba.cuda' or m.startswith('numba.cuda.') for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_numpy_compat_restores_row_stack(monkeypatch):
    """numba-cuda 0.30 overloads numpy.row_stack, which NumPy 2.5 removed."""
    monkeypatch.delattr(np, "row_stack", raising=False)
    kc.numpy_compat()
    assert np.row_stack is np.vstack
    kc.numpy_compat()                       # a second call leaves it as it is
    assert np.row_stack is np.vstack


def test_the_first_kernel_module_restores_row_stack():
    """The alias is in place before any kernel module imports numba.cuda, and only then:
    importing the package leaves numpy as it is."""
    import subprocess
    import sys
    code = ("import numpy as np; np.__dict__.pop('row_stack', None); "
            "import llamatune.kernels.cuda; print(hasattr(np, 'row_stack')); "
            "import llamatune.kernels.cuda.rope; print(np.row_stack is np.vstack)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "True"]


def test_simulator_or_gpu():
    from conftest_cuda import gpu_present
    assert kc.is_available()
    if not gpu_present():
        assert kc.simulator_enabled()


# ------------------------------------------------- the real (non-simulated) compiler
_PTX_SCRIPT = """
import re, sys
from conftest_cuda import compile_all_ptx
try:
    ptx = compile_all_ptx()
except Exception as e:
    missing = ("DynamicLibNotFoundError", "NvvmSupportError", "NvrtcSupportError",
               "CudaSupportError")
    if type(e).__name__ not in missing:  # a real compile error: fail
        raise
    print("NO-TOOLKIT", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    sys.exit(0)
for name, text in ptx.items():
    print(name, "|", len(re.findall(r"\\bfma\\.rn\\.f32", text)), "|",
          len(re.findall(r"\\bmul\\.rn\\.f32", text)))
"""


def test_kernels_compile_to_ptx_without_fma_in_dequant():
    """Every kernel goes through numba-cuda's real pipeline (typing, lowering, NVVM)
    to PTX, which the simulator never exercises; the dequant kernels contain no
    fma.rn.f32 (fmul = __nv_fmul_rn keeps NVVM from contracting d*q + m). Needs
    NVVM + NVRTC (CUDA toolkit, or the nvidia-cuda-nvcc/nvrtc wheels via
    CUDA_HOME), not a GPU; skipped without them."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    if res.stdout.startswith("NO-TOOLKIT"):
        pytest.skip(f"no CUDA compiler libraries to build PTX with: {res.stdout.strip()}")
    rows = [line.split(" | ") for line in res.stdout.strip().splitlines()]
    # dequant (plain, gather) per type; 19 elementwise, norm, loss and optimizer kernels;
    # 6 fused ones; attention: softmax forward and backward x (plain, packed) x (plain, capped); starts;
    # dequant straight to bf16 (plain, gather) per type and the bf16 rounding
    assert len(rows) == 4 * len(kc.dequant.CUDA_TYPES) + 19 + 6 + 9 + 1
    for name, n_fma, n_mul in rows:
        if name.startswith("dequant"):
            assert n_fma == "0", name
            if "Q" in name:
                assert int(n_mul) >= 1, name
