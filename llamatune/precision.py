"""The compute dtype of the frozen base's products, chosen in one place.

    f32    every product in float32 (numpy's BLAS), today's bit-exact paths.
    bf16   the base's products with bf16 inputs and float32 accumulation through
           oneDNN (llamatune.kernels.bf16): on CPUs that multiply bf16 natively
           (AVX512_BF16, AMX), about twice the float32 rate or more.
    auto   bf16 where the CPU has avx512_bf16 or amx_bf16 and oneDNN loads, else f32.

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

CHOICES = ("auto", "f32", "bf16")
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


def resolve(requested: str, device: str = "cpu", trainable: bool = False) -> tuple[str, str]:
    """compute_dtype for a run on `device` ("cpu" or a GPU backend's name): bf16 products
    are the CPU's (a GPU runs f32 or --tf32), and weights that are all trained
    (train-from-scratch, --fine-tune-type full) multiply in f32."""
    if requested not in CHOICES:
        return compute_dtype(requested)                        # the error
    if device != "cpu" or trainable:
        why = "on a GPU (use --tf32 there)" if device != "cpu" else "for weights that are trained"
        if requested == "bf16":
            raise LlamatuneError(f"--compute-dtype bf16: bf16 products are for a frozen base on the CPU, not {why}")
        return "f32", f"f32 products {why}"
    return compute_dtype(requested)


@dataclass(frozen=True)
class ComputePolicy:
    """How one run computes, decided once (`policy`) and handed to the forward, the
    training step, the memory plan and the runner.

    dtype                 "f32" or "bf16": the frozen base's products (models/products.py)
    why                   the reason, one line (the start-up line)
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

    def __post_init__(self):
        if self.dtype not in ("f32", "bf16"):
            raise ValueError(f"compute dtype {self.dtype!r}: f32 or bf16")

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
           merge_aware: bool = False) -> ComputePolicy:
    """The run's ComputePolicy for --compute-dtype `requested` on `device` (`resolve`):
    with bf16 products the adapters ride in them (but for merge-aware training, whose
    matrices are the requantized merge in f32) and attention and the adapters' products
    run on the bf16 / oneDNN kernels; with f32 products adapters may merge into
    dequantized copies."""
    dtype, why = resolve(requested, device, trainable)
    bf16 = dtype == "bf16"
    return ComputePolicy(dtype, why, merge_adapters=not bf16, adapters_in_products=bf16 and not merge_aware,
                         merge_aware=merge_aware, attention_kernels="bf16" if bf16 else "backend",
                         lora_kernels="onednn" if bf16 else "backend")
