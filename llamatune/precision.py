"""The compute dtype of the frozen base's products, chosen in one place.

    f32    every product in float32 (numpy's BLAS), today's bit-exact paths.
    bf16   the base's products with bf16 inputs and float32 accumulation through
           oneDNN (llamatune.kernels.bf16): on CPUs that multiply bf16 natively
           (AVX512_BF16, AMX), about twice the float32 rate or more.
    auto   bf16 where the CPU has avx512_bf16 or amx_bf16 and oneDNN loads, else f32.
    tf32   a GPU only: float32 products on tensor cores in TF32 (--tf32 is its alias).
On a GPU (`resolve_gpu`) bf16 products go through cuBLAS (kernels/cuda/bf16.py) and
auto picks them from compute capability 8.0 on.

`compute_dtype(requested)` resolves the choice and says why, in one line, for the
start-up line; an explicit bf16 that cannot run is a LlamatuneError. `policy(...)` makes,
once per run, the `ComputePolicy` every part of the run reads: the dtype and why, the
smallest product that runs in bf16, whether adapters merge into dequantized matrices or
ride inside the bf16 products, merge-aware training, and the kernels of attention and of
the adapters' rank-r products. Nothing else decides these, and nothing writes them back
into the options; a checkpoint records the policy (`record`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from .errors import LlamatuneError

CHOICES = ("auto", "f32", "tf32", "bf16")
BF16_MIN_ROWS = 16     # fewer rows (a decode step's one token) multiply in f32: oneDNN's bf16 kernels
#                        run matrix-vector products slower than BLAS, and the weight's bf16 copy costs
#                        as much as its f32 one
BF16_SPIN = "100000"   # GOMP_SPINCOUNT where the products are likely oneDNN's bf16 ones (prepare_threads)


def prepare_threads(requested: str | None, device: str = "cpu", trainable: bool = False,
                    environ=os.environ) -> None:
    """Before OpenMP starts (the first numba kernel or oneDNN product reads the variable
    once): where this run's products will likely be bf16 (requested auto or bf16, a
    frozen base on a CPU that multiplies bf16 natively), let idle OpenMP workers spin
    longer (GOMP_SPINCOUNT BF16_SPIN in place of the package's 2000). oneDNN's products
    and numba's kernels then run on the same workers, and a worker asleep takes about
    70 us to wake on this project's 2-core VM: a (256 x 512) x (512 x 256) bf16 product
    took 135 us with the short spin and 65 us with this one, and a step of the bench
    shape launches some 900 parallel regions. With f32 products the short spin stays:
    OpenBLAS's own threads would wait for the spinning workers (the bench shape's f32
    step 7 % slower with the long spin). A value the user set (other than the package's
    default) is kept; `requested` None (a command without products) changes nothing."""
    from . import SPIN
    if requested is None or environ.get("GOMP_SPINCOUNT", SPIN) != SPIN:
        return
    from .kernels.cpuinfo import cpu_bf16_flags                   # reads /proc/cpuinfo, loads nothing
    likely_bf16 = requested in ("auto", "bf16") and device in ("cpu", "auto") and not trainable
    environ["GOMP_SPINCOUNT"] = BF16_SPIN if likely_bf16 and cpu_bf16_flags() else SPIN


def compute_dtype(requested: str) -> tuple[str, str]:
    """("f32" or "bf16", the reason in one line) for --compute-dtype `requested`."""
    if requested not in CHOICES:
        raise LlamatuneError(f"--compute-dtype: unknown value {requested!r} "
                             f"(choose one of {', '.join(CHOICES)})")
    if requested == "f32":
        return "f32", "f32 products as asked"
    if requested == "tf32":       # a GPU's tf32 run resumed here (an explicit one is refused with --device cpu)
        return "f32", "f32 products: TF32 is a GPU's tensor-core mode"
    from .kernels import bf16
    flags = bf16.cpu_bf16_flags()
    problem = None
    if not flags:
        problem = "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"
    elif not bf16.available():
        problem = bf16.unavailable_reason()
    if problem is None:
        return "bf16", (f"bf16 products (oneDNN {bf16.library_version()}, CPU {'+'.join(flags)})"
                        + (" as asked" if requested == "bf16" else ""))
    if requested == "bf16":
        raise LlamatuneError(f"--compute-dtype bf16: {problem}")
    return "f32", f"f32 products: {problem}"


def resolve(requested: str, device: str = "cpu", trainable: bool = False,
            capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """compute_dtype for a run on `device` ("cpu" or a GPU backend's name; a GPU's
    compute `capability`, None where unknown: `resolve_gpu`); weights that are all
    trained (train-from-scratch, --fine-tune-type full) multiply in f32 (tf32 on a GPU
    where asked)."""
    if requested not in CHOICES:
        return compute_dtype(requested)                        # the error
    if device != "cpu":
        return resolve_gpu(requested, capability, trainable)
    if trainable and requested != "tf32":
        if requested == "bf16":
            raise LlamatuneError("--compute-dtype bf16: bf16 products are for a frozen base, not for weights "
                                 "that are trained")
        return "f32", "f32 products for weights that are trained"
    return compute_dtype(requested)


@dataclass(frozen=True)
class ComputePolicy:
    """How one run computes, decided once (`policy`) and handed to the forward, the
    training step, the memory plan and the runner.

    dtype                 "f32", "tf32" (a GPU's float32 products on tensor cores) or
                          "bf16": the frozen base's products (models/products.py)
    why                   the reason, one line (the start-up line)
    device                "cpu" or "cuda": where the products run. The CPU's bf16 layout
                          (oneDNN products, bf16 saved activations, the kept bf16 head,
                          adapters inside the products: `host_bf16`) is the CPU's alone; a
                          GPU's bf16 products go through cuBLAS on float32 activations
    bf16_min_rows         a product over fewer rows multiplies in f32 even with bf16
    merge_adapters        an adapter may be added into a dequantized f32 copy of its matrix
                          (W + s B A) where that costs less (not with bf16: the rounding
                          would take the adapter's share)
    adapters_in_products  with bf16 products an adapter rides in its base product's K axis
                          (products.Products.adapted; where its input has no dropout)
    merge_aware           adapted quantized matrices used as deq(Q(W + s B A)) (--merge-aware)
    attention_kernels     "backend" (the backend's float32 attention) or "bf16"
                          (kernels/attention_bf16.py)
    lora_kernels          "backend" (the backend's rank-r products) or "onednn"
                          (kernels/lora.py's oneDNN float32 pair)
    """
    dtype: str = "f32"
    why: str = "f32 products"
    bf16_min_rows: int = BF16_MIN_ROWS
    merge_adapters: bool = True
    adapters_in_products: bool = False
    merge_aware: bool = False
    attention_kernels: str = "backend"
    lora_kernels: str = "backend"
    device: str = "cpu"

    def __post_init__(self):
        if self.dtype not in ("f32", "tf32", "bf16"):
            raise ValueError(f"compute dtype {self.dtype!r}: f32, tf32 or bf16")
        if self.dtype == "tf32" and self.device == "cpu":
            raise ValueError("compute dtype tf32 is a GPU's")

    @property
    def host_bf16(self) -> bool:
        """The CPU's bf16 layout: oneDNN products, bf16 saved activations, the kept bf16 head."""
        return self.dtype == "bf16" and self.device == "cpu"

    @property
    def tensor_cores(self) -> bool:
        """A GPU's float32 products run in TF32 (backend.set_tf32): with tf32, and beside bf16."""
        return self.device != "cpu" and self.dtype in ("tf32", "bf16")

    def bf16_for(self, rows: int) -> bool:
        """Whether a product over `rows` tokens runs in bf16 (and wants its weight in bf16)."""
        return self.dtype == "bf16" and rows >= self.bf16_min_rows

    def attention(self, backend_attention):
        """Attention's kernels (attention_forward, attention_backward): the backend's, or
        kernels/attention_bf16.py, whose products but the scores q k^T run in bf16 through
        oneDNN (decode steps, float64 and soft-capped scores go to the float32 kernels)."""
        if self.attention_kernels == "backend":
            return backend_attention
        from .kernels import attention_bf16
        return attention_bf16

    def lora(self, backend_lora):
        """The adapters' rank-r products (lora_forward, lora_backward, lora_grads, lora_xa):
        the backend's (numpy's bit-exact sums on the CPU), or oneDNN's float32 kernels
        (kernels/lora.py: the adds in the products' one pass, about 1.6x numpy's rate on a
        layer of the bench shape)."""
        if self.lora_kernels == "backend":
            return backend_lora
        from .kernels import lora
        return SimpleNamespace(lora_forward=lora.lora_forward_onednn, lora_backward=lora.lora_backward_onednn,
                               lora_grads=lora.lora_grads_onednn, lora_xa=lora.lora_xa_onednn)

    def record(self) -> dict:
        """The policy as a checkpoint keeps it (JSON)."""
        return asdict(self)


F32 = ComputePolicy()          # float32 throughout: the bit-exact paths (tests, tools, inference by default)


def policy(requested: str = "f32", device: str = "cpu", trainable: bool = False,
           merge_aware: bool = False, capability: tuple[int, int] | None = None) -> ComputePolicy:
    """The run's ComputePolicy for --compute-dtype `requested` on `device` (`resolve`; a
    GPU's compute `capability`): with the CPU's bf16 products the adapters ride in them
    (but for merge-aware training, whose matrices are the requantized merge in f32) and
    attention and the adapters' products run on the bf16 / oneDNN kernels; a GPU's bf16
    products (cuBLAS) take every product in bf16 and keep the backend's float32 kernels
    beside them; with f32 (or tf32) products adapters may merge into dequantized copies."""
    dtype, why = resolve(requested, device, trainable, capability)
    bf16, host = dtype == "bf16", device == "cpu"
    return ComputePolicy(dtype, why, bf16_min_rows=BF16_MIN_ROWS if host else 1, merge_adapters=not bf16,
                         adapters_in_products=bf16 and host and not merge_aware, merge_aware=merge_aware,
                         attention_kernels="bf16" if bf16 and host else "backend",
                         lora_kernels="onednn" if bf16 and host else "backend", device=device)


def resolve_gpu(requested: str, capability: tuple[int, int] | None, trainable: bool) -> tuple[str, str]:
    """A GPU's products: bf16 through cuBLAS with float32 sums (tensor cores from compute
    capability 8.0, Ampere), tf32 (CuPy's float32 products in TF32), or f32. auto: bf16
    for a frozen base on a GPU of capability 8.0 or newer, else f32 (also where the
    capability is unknown: numba's CUDA simulator, inference)."""
    cc = "" if capability is None else f" (compute capability {capability[0]}.{capability[1]})"
    if trainable:
        if requested == "bf16":
            raise LlamatuneError("--compute-dtype bf16: bf16 products are for a frozen base, not for weights "
                                 "that are trained")
        return ("tf32", "tf32 products for weights that are trained") if requested == "tf32" else \
            ("f32", "f32 products for weights that are trained")
    if requested in ("f32", "tf32"):
        return requested, f"{requested} products on the GPU as asked"
    new_enough = capability is not None and tuple(capability) >= (8, 0)
    if requested == "bf16":
        if capability is not None and not new_enough:
            raise LlamatuneError(f"--compute-dtype bf16: this GPU{cc} has no bf16 tensor cores (8.0 or newer)")
        return "bf16", f"bf16 products on the GPU{cc}, float32 sums (cuBLAS) as asked"
    if new_enough:
        return "bf16", f"bf16 products on the GPU{cc}, float32 sums (cuBLAS)"
    return "f32", f"f32 products on the GPU{cc or ' (capability unknown)'}: bf16 needs compute capability 8.0"
