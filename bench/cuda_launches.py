"""Count the GPU launches of one LoRA training step on the CUDA path, per phase.

Runs one `StepExecutor.step` of a micro model (one layer, F32 weights, LoRA r=2 on every
layer matrix) on the CUDA backend in numba's CUDA simulator, and counts what a GPU
would launch:
  kernel   a numba-cuda kernel launch (llamatune.kernels.cuda);
  ufunc    an array operation the backend's array module runs (CuPy on a GPU):
           a matmul (cuBLAS), an elementwise op or a reduction (one CuPy kernel each,
           plus one for a temporary it fills);
  copy     an assignment into a slice of a device array (a CuPy copy kernel);
  fill     a memset (`a.fill(0)`).
It wraps the simulator's arrays in an ndarray subclass that counts those calls, so a
count is of the code path (the same on a GPU, where CuPy may add a copy for a
non-contiguous operand), not of a profiler's trace. Phases: embed, layer forward,
head (loss and its gradient), layer backward, embed backward.

    NUMBA_ENABLE_CUDASIM=1 python bench/cuda_launches.py [--arch llama|qwen3|gemma3] [--detail]
        [--checkpointing layer|selective|none] [--compute-dtype f32|bf16]

--detail lists every counted call site (file:line, kind, count) of the layer phases.
Runs in about 10 s per architecture on one core (the simulator runs each thread in Python).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

MICRO = dict(n_vocab=32, n_ctx_train=64, n_embd=16, n_ff=24, n_head=2, n_head_kv=1, head_dim=8, n_rot=8,
             n_layer=1, norm_eps=1e-5)
ARCHS = {"llama": {}, "qwen3": {},
         "gemma3": dict(sliding_window=3, swa_pattern=2, rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0)}


class Counter:
    def __init__(self):
        self.phase = "setup"
        self.in_kernel = 0
        self.counts = collections.Counter()          # (phase, kind) -> n
        self.sites = collections.Counter()           # (phase, kind, site) -> n

    def add(self, kind: str, name: str = "") -> None:
        if self.in_kernel:
            return
        site = next((f"{Path(f.filename).name}:{f.lineno} {name}".strip()
                     for f in reversed(traceback.extract_stack()[:-2])
                     if "/llamatune/" in f.filename and "/kernels/cuda/" not in f.filename
                     and not f.filename.endswith("backend.py")), name)
        self.counts[self.phase, kind] += 1
        self.sites[self.phase, kind, site] += 1


COUNT = Counter()


class Counted(np.ndarray):
    """numpy memory standing for device memory: counts the ops a GPU would launch."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        COUNT.add("ufunc", ufunc.__name__ + ("" if method == "__call__" else "." + method))
        plain = [i.view(np.ndarray) if isinstance(i, Counted) else i for i in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Counted) else o for o in out)
        res = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return res.view(Counted) if isinstance(res, np.ndarray) else res

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray) and value.ndim > 0:
            COUNT.add("copy")
        super().__setitem__(key, value)

    def fill(self, value):
        COUNT.add("fill")
        super().fill(value)


class CountingNumpy:
    """numpy, except that the arrays it makes are Counted (the Backend's `xp`)."""

    def __getattr__(self, name):
        f = getattr(np, name)
        if name in ("zeros", "empty", "ones", "full", "asarray", "ascontiguousarray", "zeros_like",
                    "empty_like", "array"):
            return lambda *a, **k: f(*a, **k).view(Counted)
        return f


def install_kernel_counter() -> None:
    from numba.cuda.simulator import kernel as simulated
    launch = simulated.FakeCUDAKernel.__call__

    def __call__(self, *args):
        if self._device or simulated._kernel_context:
            return launch(self, *args)
        COUNT.add("kernel", self.__name__)
        COUNT.in_kernel += 1
        try:
            return launch(self, *args)
        finally:
            COUNT.in_kernel -= 1
    simulated.FakeCUDAKernel.__call__ = __call__
    try:
        from llamatune.kernels.cuda import lora           # its cuBLAS products: one launch each
    except ImportError:                                   # an earlier llamatune (a baseline count)
        return
    count_calls(lora, "gemm")
    try:
        from llamatune.kernels.cuda import bf16           # the bf16 products' cublasGemmEx calls
    except ImportError:
        return
    count_calls(bf16, "gemm_bf16")


def count_calls(module, name: str) -> None:
    """Count each call of module.name as one launch (a cuBLAS product), not what it runs inside."""
    product = getattr(module, name)

    def counted(*args, **kwargs):
        COUNT.add("ufunc", name)
        COUNT.in_kernel += 1
        try:
            return product(*args, **kwargs)
        finally:
            COUNT.in_kernel -= 1
    setattr(module, name, counted)


@contextlib.contextmanager
def phase(name):
    before, COUNT.phase = COUNT.phase, name
    try:
        yield
    finally:
        COUNT.phase = before


def counted_backend():
    from llamatune.backend import Backend, get_backend
    sim = get_backend("cuda")
    assert sim.simulated, "run with NUMBA_ENABLE_CUDASIM=1 (counts are of the simulated path)"
    return Backend("cuda", CountingNumpy(), sim.ops, simulated=True)


def build(path: Path, arch: str):
    from finetune_step import dummy_vocab              # bench/ is sys.path[0] when run as a script
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import random_weights, write_model
    cfg = ModelConfig(arch=arch, **MICRO, **ARCHS[arch])
    write_model(path, cfg, random_weights(cfg, seed=0, std=0.08), dummy_vocab(cfg.n_vocab))
    return path


def count_step(arch: str, B: int = 1, T: int = 6, compute_dtype: str = "f32", mode: str = "selective") -> Counter:
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    install_kernel_counter()
    backend = counted_backend()
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(build(Path(tmp) / "m.gguf", arch))
        cfg = model.config
        kinds = [k for k in cfg.spec.layer if "." not in k and not k.endswith("norm")]
        targets = lora_targets(cfg, {k: 2 for k in kinds}, 2.0, tied=False)
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(1))
        params.to_device(backend)
        g = StepExecutor(cfg, FrozenBase(model, backend), params, targets, B, T, mode, backend=backend,
                  **({} if compute_dtype == "f32" else {"compute_dtype": compute_dtype}))
        for name, owner, method in (("layer forward", g, "layer_forward"), ("layer backward", g, "layer_backward"),
                                    ("head", g.head, "loss"), ("embed", g, "embed"),
                                    ("embed backward", g, "_embed_backward")):
            wrapped = getattr(owner, method)

            def run(*a, _w=wrapped, _n=name, **k):
                with phase(_n):
                    return _w(*a, **k)
            setattr(owner, method, run)
        rng = np.random.default_rng(0)
        inputs, labels = rng.integers(0, cfg.n_vocab, (2, B, T))
        g.step(inputs, labels, np.full((B, T), 1 / (B * T), np.float32))   # compiles nothing: the simulator
        COUNT.counts.clear()
        COUNT.sites.clear()
        g.step(inputs, labels, np.full((B, T), 1 / (B * T), np.float32))
    return COUNT


def quick_simulator() -> None:
    """Hand the simulator's threads over every 50 us instead of every 5 ms, as the CUDA
    tests run it (tests/conftest.py): the threads of a block meet at each syncthreads(),
    and the qwen3 count took 31 s on two cores (111 s in a GPU machine's test run), 13 s
    so. A thread switch inside the simulator's shared-array lookup can then hand two
    threads two arrays (tests/conftest_cuda.py patches that for the tests): that changes
    values, never what is launched, which is all this counts."""
    import sys
    sys.setswitchinterval(5e-5)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    ap.add_argument("--detail", action="store_true", help="every call site of the layer phases")
    ap.add_argument("--checkpointing", default="selective", choices=("layer", "selective", "none"))
    ap.add_argument("--compute-dtype", default="f32", choices=("f32", "bf16"),
                    help="the base's products: float32, or bf16 (kernels/cuda/bf16.py)")
    args = ap.parse_args(argv)
    quick_simulator()
    c = count_step(args.arch, compute_dtype=args.compute_dtype, mode=args.checkpointing)
    kinds = ("kernel", "ufunc", "copy", "fill")
    print(f"{args.arch}: launches of one training step (1 layer, LoRA on every layer matrix, "
          f"{args.checkpointing}, {args.compute_dtype} products)")
    print(f"{'phase':16}" + "".join(f"{k:>8}" for k in kinds) + f"{'total':>8}")
    for ph in ("embed", "layer forward", "head", "layer backward", "embed backward"):
        row = [c.counts[ph, k] for k in kinds]
        print(f"{ph:16}" + "".join(f"{n:8d}" for n in row) + f"{sum(row):8d}")
    total = [sum(n for (p, k), n in c.counts.items() if k == kind) for kind in kinds]
    print(f"{'step':16}" + "".join(f"{n:8d}" for n in total) + f"{sum(total):8d}")
    if args.detail:
        for (ph, kind, site), n in sorted(c.sites.items()):
            if ph.startswith("layer"):
                print(f"  {ph:15} {kind:7} {n:3d}  {site}")


if __name__ == "__main__":
    main()
