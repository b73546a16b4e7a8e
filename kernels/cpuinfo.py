"""What the CPU multiplies natively, from /proc/cpuinfo (no numba, no library loaded:
the thread policy reads it before OpenMP starts, llamatune/precision.py), and a context
that holds BLAS at one thread (threadpoolctl, loaded on first use)."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

_BLAS = None


def blas_one_thread():
    """Context: BLAS at one thread (threadpoolctl; without it, a no-op): attention's
    workers each run their own products, and export-lora's merged tensors' products are
    many and small, where OpenBLAS's second thread costs more than it gives."""
    global _BLAS
    if _BLAS is None:
        try:
            from threadpoolctl import ThreadpoolController
            _BLAS = ThreadpoolController()
        except ImportError:
            _BLAS = False
    return _BLAS.limit(limits=1, user_api="blas") if _BLAS else nullcontext()


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's native bf16 flags among avx512_bf16 and amx_bf16 (empty when none, or
    when the file cannot be read: then the CPU is taken to lack them)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return []
