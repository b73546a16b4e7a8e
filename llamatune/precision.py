"""The compute dtype of the frozen base's products, chosen in one place.

    f32    every product in float32 (numpy's BLAS), today's bit-exact paths.
    bf16   the base's products with bf16 inputs and float32 accumulation through
           oneDNN (llamatune.kernels.bf16): on CPUs that multiply bf16 natively
           (AVX512_BF16, AMX), about twice the float32 rate or more.
    auto   bf16 where the CPU has avx512_bf16 or amx_bf16 and oneDNN loads, else f32.

`compute_dtype(requested)` resolves the choice and says why, in one line, for the
start-up line; an explicit bf16 that cannot run is a LlamatuneError.
"""
from __future__ import annotations

from .errors import LlamatuneError

CHOICES = ("auto", "f32", "bf16")


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
