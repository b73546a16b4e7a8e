"""What the CPU multiplies natively, from /proc/cpuinfo (no numba, no library loaded:
the thread policy reads it before OpenMP starts, llamatune/precision.py)."""
from __future__ import annotations

from pathlib import Path


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
