"""LoRA adapters in today's llama.cpp GGUF format (src/llama-adapter.cpp).

File: `general.type=adapter`, `adapter.type=lora`, `adapter.lora.alpha` (f32),
`general.architecture` = the base model's. Tensors `<base name>.lora_a` and
`.lora_b`; in numpy order A is (r, n_in) and B is (n_out, r) (ggml ne `[n_in, r]`
and `[r, n_out]`), exactly PEFT's lora_A/lora_B weights. The rank is B's last
dimension. `token_embd.weight` is flipped: A is (n_vocab, r), B is (n_embd, r),
applied as `B · A[tokens]^T`. Norm adapters are allowed in the file but llama.cpp
skips them at run time (only export-lora merges them).

Effect on a weight W (n_out, n_in): W' = W + s · B A with s = user_scale·alpha/r
(user_scale alone when alpha is 0), computed in factored form.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..console import notice
from ..errors import LlamatuneError, listed
from ..kernels import dequant
from .gguf_io import KV, GGUFFile, kv, tensor_out, write_gguf
from .tensors import check_finite, check_type


@dataclass
class LoraAdapter:
    """An adapter: per base weight name, A and B as f32 arrays (see module docstring)."""
    arch: str
    alpha: float
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    path: Path | None = None

    def rank(self, name: str) -> int:
        return self.pairs[name][1].shape[-1]

    def scale(self, name: str, user_scale: float = 1.0) -> float:
        return user_scale * self.alpha / self.rank(name) if self.alpha else user_scale


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def expected_shapes(name: str, base_shape: tuple[int, ...], r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Numpy shapes of (A, B) for a rank-r adapter on a base weight of `base_shape`; a 3-D
    expert tensor (E, n_out, n_in) has one pair per expert, A (E, r, n_in) and B (E, n_out, r)
    (llama.cpp's build_lora_mm_id)."""
    if len(base_shape) == 3:
        n_expert, n_out, n_in = base_shape
        return (n_expert, r, n_in), (n_expert, n_out, r)
    if name == "token_embd.weight":
        n_vocab, n_embd = base_shape
        return (n_vocab, r), (n_embd, r)
    n_out, n_in = base_shape if len(base_shape) == 2 else (1, base_shape[0])
    return (r, n_in), (n_out, r)


def _f32(t) -> np.ndarray:
    if t.qtype == QType.F32:
        return np.array(t.data, np.float32).reshape(t.shape)
    return dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape)


def read_adapter(path: str | Path, base: GGUFFile, allow_nonfinite: bool = False) -> LoraAdapter:
    """Read and validate an adapter against its base model. Every problem (arch,
    names, shapes, missing halves) is collected and reported in one error; then
    tensor types are checked and every value must be finite (unless `allow_nonfinite`)."""
    f = GGUFFile(path)
    problems: list[str] = []
    if f.get("general.type") != "adapter" or f.get("adapter.type") != "lora":
        raise LlamatuneError(f"{f.path}: not a LoRA adapter (general.type={str(f.get('general.type'))[:40]!r}, "
                             f"adapter.type={str(f.get('adapter.type'))[:40]!r}; expected 'adapter' and 'lora')")
    if f.get("general.architecture") != base.arch:
        problems.append(f"architecture {str(f.get('general.architecture'))[:40]!r} differs from the base model's "
                        f"'{base.arch}'")
    alpha = f.get_float("adapter.lora.alpha", 0.0)
    halves: dict[str, dict[str, object]] = {}
    for name, t in f.tensors.items():
        stem, dot, suffix = name.rpartition(".")
        if suffix not in ("lora_a", "lora_b"):
            problems.append(f"tensor '{name}' is not a .lora_a/.lora_b tensor")
            continue
        halves.setdefault(stem, {})[suffix] = t
    adapter = LoraAdapter(base.arch, alpha, path=f.path)
    for stem, h in halves.items():
        if len(h) != 2:
            missing = "lora_b" if "lora_a" in h else "lora_a"
            problems.append(f"'{stem}' has no .{missing}")
            continue
        if stem not in base.tensors:
            problems.append(f"'{stem}' is not a tensor of the base model")
            continue
        a, b = h["lora_a"], h["lora_b"]
        r = b.shape[-1]
        ea, eb = expected_shapes(stem, base.tensors[stem].shape, r)
        if a.shape != ea or b.shape != eb:
            problems.append(f"'{stem}': lora_a {a.shape} / lora_b {b.shape} do not fit the base shape "
                            f"{base.tensors[stem].shape} at rank {r} (expected {ea} / {eb})")
            continue
        adapter.pairs[stem] = (a, b)
    if not adapter.pairs and not problems:
        problems.append("it holds no adapter tensors")
    if problems:
        raise LlamatuneError(f"{f.path}: adapter does not fit {base.path.name}: " + listed(problems))
    tensors = [(t.name, t) for pair in adapter.pairs.values() for t in pair]
    for _, t in tensors:
        check_type(f, t)
    check_finite(f.path, tensors, allow_nonfinite)
    adapter.pairs = {stem: (_f32(a), _f32(b)) for stem, (a, b) in adapter.pairs.items()}
    return adapter


def write_adapter(path: str | Path, adapter: LoraAdapter, extra: list[KV] | None = None,
                  name: str = "llamatune LoRA adapter") -> None:
    """Write an adapter llama.cpp loads with --lora (F32 tensors), atomically."""
    kvs = [kv("general.type", "adapter"), kv("general.name", name), kv("adapter.type", "lora"),
           kv("adapter.lora.alpha", float(adapter.alpha))] + list(extra or [])
    tensors = []
    for stem, (a, b) in adapter.pairs.items():
        tensors.append(tensor_out(f"{stem}.lora_a", np.ascontiguousarray(a, np.float32)))
        tensors.append(tensor_out(f"{stem}.lora_b", np.ascontiguousarray(b, np.float32)))
    write_gguf(path, adapter.arch, kvs, tensors)


@dataclass
class RuntimeAdapters:
    """LoRA adapters applied at run time: weight name -> [(A (r, n_in), B (n_out, r), scale)].
    `token_embd.weight` entries use llama.cpp's flipped layout: A (V, r), B (C, r)."""
    by_weight: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = field(default_factory=dict)

    def add(self, name: str, a: np.ndarray, b: np.ndarray, scale: float) -> None:
        self.by_weight.setdefault(name, []).append((a, b, scale))

    def __bool__(self) -> bool:
        return bool(self.by_weight)



def load_runtime_adapters(model, specs: list[tuple[str, float]], allow_nonfinite: bool = False):
    """Adapters to apply at run time, as llama.cpp's --lora / --lora-scaled do
    (norm adapters are skipped, as llama.cpp skips them)."""
    runtime = RuntimeAdapters()
    for path, user_scale in specs:
        adapter = read_adapter(path, model.file, allow_nonfinite)
        skipped = [n for n in adapter.pairs if is_norm(n)]
        if skipped:
            notice(f"{Path(path).name}: {len(skipped)} norm adapters are not applied at run time "
                   "(llama.cpp ignores them too; export-lora merges them)")
        for name, (a, b) in adapter.pairs.items():
            if not is_norm(name):
                runtime.add(name, a, b, adapter.scale(name, user_scale))
    return runtime
