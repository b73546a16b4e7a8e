"""llama.cpp's importance-matrix GGUF (`llama-imatrix -o FILE.gguf`, read by
`llama-quantize --imatrix`), as tools/imatrix/imatrix.cpp writes it and
common/imatrix-loader.cpp reads it:

  KVs      general.type = "imatrix"; imatrix.datasets (string array);
           imatrix.chunk_count, imatrix.chunk_size (u32)
  tensors  per weight W: `<W>.in_sum2` F32 ne [n_in, n_mat] = the sum over tokens of x^2
           of W's input, per column; `<W>.counts` F32 ne [1, n_mat] = the number of tokens
           (n_mat > 1 only for MoE expert stacks)

The importance of a column is in_sum2 / counts (llama-quantize: 1 where counts is 0).
The old binary `.dat` format (before llama.cpp's GGUF imatrix) is not read.
`finetune` writes one beside each adapter (train/statistics.py), named by `beside`;
export-lora uses it when given no statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as VType

from ..errors import LlamatuneError
from .gguf_io import GGUFError, GGUFFile, kv, tensor_out, write_gguf

SUMS, COUNTS = ".in_sum2", ".counts"


@dataclass
class IMatrix:
    """Per weight name: sum of x^2 per input column (n_in,) float64 and the token count."""
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def importance(self, name: str) -> np.ndarray | None:
        """mean x^2 per input column of weight `name` (float32), None if not collected;
        ones where no token was seen, as llama-quantize."""
        if name not in self.sums:
            return None
        n = self.counts[name]
        return (self.sums[name] / n).astype(np.float32) if n > 0 else np.ones_like(self.sums[name], np.float32)


def beside(adapter: str | Path) -> Path:
    """The imatrix finetune writes with an adapter: adapter-12.gguf -> adapter-12.imatrix.gguf."""
    adapter = Path(adapter)
    stem = adapter.name[:-5] if adapter.name.endswith(".gguf") else adapter.name
    return adapter.with_name(stem + ".imatrix.gguf")


def write_imatrix(path: str | Path, stats: IMatrix, arch: str) -> None:
    """Write `stats` atomically in llama.cpp's imatrix GGUF format."""
    kvs = [kv("general.type", "imatrix"), kv("imatrix.datasets", list(stats.datasets) or [""]),
           kv("imatrix.chunk_count", stats.chunk_count, VType.UINT32),
           kv("imatrix.chunk_size", stats.chunk_size, VType.UINT32)]
    tensors = []
    for name in sorted(stats.sums):
        tensors.append(tensor_out(name + SUMS, stats.sums[name].astype(np.float32).reshape(1, -1)))
        tensors.append(tensor_out(name + COUNTS, np.array([[stats.counts[name]]], np.float32)))
    write_gguf(path, arch, kvs, tensors)


def read_imatrix(path: str | Path) -> IMatrix:
    """Read an imatrix GGUF; one clear error for anything else."""
    f = GGUFFile(path)
    kind = f.get("general.type")
    names = {n[: -len(SUMS)] for n in f.tensors if n.endswith(SUMS)}
    if kind not in (None, "imatrix") or not names:
        raise GGUFError(f"{f.path}: not an importance matrix (no '*{SUMS}' tensors"
                        + (f"; general.type is '{kind}'" if kind else "") + ")")
    stats = IMatrix(datasets=[str(d) for d in (f.get("imatrix.datasets") or [])],
                    chunk_count=int(f.get("imatrix.chunk_count", 0)), chunk_size=int(f.get("imatrix.chunk_size", 0)))
    for name in sorted(names):
        if name + COUNTS not in f.tensors:
            raise GGUFError(f"{f.path}: '{name}{SUMS}' has no '{name}{COUNTS}'")
        sums, counts = f.tensor(name + SUMS), f.tensor(name + COUNTS)
        if sums.qtype.name != "F32" or counts.qtype.name != "F32":
            raise GGUFError(f"{f.path}: '{name}' sums and counts must be F32")
        c = np.asarray(counts.raw_rows()).view(np.float32).reshape(-1)
        if c.size != 1:
            raise GGUFError(f"{f.path}: '{name}' has statistics for {c.size} experts; llamatune merges "
                            "dense weights only")
        s = np.asarray(sums.raw_rows()).view(np.float32).reshape(-1).astype(np.float64)
        if not (np.all(np.isfinite(s)) and np.all(s >= 0) and np.isfinite(c[0]) and c[0] >= 0):
            raise GGUFError(f"{f.path}: '{name}' holds negative or non-finite statistics")
        stats.sums[name], stats.counts[name] = s, int(c[0])
    return stats


def check_against(stats: IMatrix, source: Path, n_cols: dict[str, int]) -> None:
    """Every entry for a weight of the model must have that weight's input width."""
    bad = [f"'{n}' has {len(s)} columns, the model's {n_cols[n]}" for n, s in stats.sums.items()
           if n in n_cols and len(s) != n_cols[n]]
    if bad:
        raise LlamatuneError(f"{source}: importance matrix of another model: " + "; ".join(bad[:3])
                             + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""))
