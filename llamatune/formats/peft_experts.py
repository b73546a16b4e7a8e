"""PEFT's LoRA on fused 3-D expert parameters (LoraConfig.target_parameters, peft's
lora.ParamWrapper) <-> llama.cpp's per-expert adapters (formats/adapter.py), without torch.

An architecture declares its HF expert parameters (models/arch.Arch.peft_experts), e.g.
qwen3moe's `mlp.experts.gate_up_proj` (E, 2F, C), rows gate | up ("stacked"), =
ffn_gate_exps and ffn_up_exps (E, F, C), and `mlp.experts.down_proj` (E, C, F) =
ffn_down_exps; gpt-oss's gate_up_proj (E, C, 2F) holds gate and up in alternate output
columns ("interleaved": gate = [..., ::2], up = [..., 1::2], as llama.cpp's converter
splits it). PEFT adapts a 3-D parameter of n_in inputs and n_out outputs (stored
(E, n_out, n_in), or (E, n_in, n_out) where the HF module says is_transposed: the
factors are the same) with rank r per expert as

  lora_A.weight (E r, n_in)    expert e's A: rows e r ... e r + r - 1 (expert-major)
  lora_B.weight (n_out, r E)   expert e's B: columns e, E + e, 2E + e, ... (rank-major)
  delta_e = lora_alpha / r * B_e A_e                         (peft ParamWrapper.get_delta_weight)

and llama.cpp's build_lora_mm_id reads A (E, r, n_in), B (E, n_out, r) per tensor. Several
parameters of one module nest: PEFT wraps them in the module's parameter order (the
declaration's), so the first is innermost, its tensors under `...experts.base_layer.`
once per wrapper around it; the last under `...experts.` itself.

A fused gate | up parameter: from PEFT, gate and up share A, and B splits by rows (exact);
to PEFT, gate and up with their own A's become one pair of rank 2r, A = [A_g; A_u],
B = [[B_g, 0], [0, B_u]] (exact: rank_pattern and alpha_pattern keep the scale alpha / r),
or rank r where A_g equals A_u (an adapter that came from PEFT).
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import LlamatuneError

Experts = tuple[tuple[tuple[str, ...], str, str], ...]
#  ((GGUF kinds whose rows it holds), HF parameter under model.layers.N., "stacked" | "interleaved")


def _module(path: str) -> str:
    return path.rsplit(".", 1)[0]


def expert_module(module: str, experts: Experts) -> tuple[int, str, int] | None:
    """(layer, the experts module, wrappers around the key's) for a PEFT module name such as
    `model.layers.3.mlp.experts.base_layer`; None for any other module."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)((?:\.base_layer)*)", module)
    if not m or m.group(2) not in {_module(p) for _, p, _ in experts}:
        return None
    return int(m.group(1)), m.group(2), m.group(3).count(".base_layer")


def targeted(layer: int, experts: Experts, targets: list[str]) -> list[tuple[tuple[str, ...], str, str]]:
    """The declared parameters of layer `layer` that the config's target_parameters name
    (a full name or a dotted suffix, as PEFT matches them), in nesting order."""
    out = []
    for kinds, path, rows in experts:
        full = f"model.layers.{layer}.{path}"
        if any(full == t or full.endswith("." + t) for t in targets):
            out.append((kinds, path, rows))
    return out


def _kind_rows(n: int, k: int, i: int, rows: str) -> slice:
    """The rows of kind i of k in a parameter of n outputs."""
    return slice(i, None, k) if rows == "interleaved" else slice(i * (n // k), (i + 1) * (n // k))


def from_peft(a: np.ndarray, b: np.ndarray, r: int, kinds: tuple[str, ...], rows: str, layer: int, where: str
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GGUF (A (E, r, n_in), B (E, n_out, r)) of each kind of one PEFT expert pair."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or r < 1 or a.shape[0] % r:
        raise LlamatuneError(f"{where}: layer {layer} {'/'.join(kinds)}: lora_A {a.shape} and lora_B {b.shape} "
                             f"are not rank {r} per expert")
    E = a.shape[0] // r
    A = a.reshape(E, r, a.shape[1])
    B = b.reshape(b.shape[0], r, E).transpose(2, 0, 1)            # (E, n_out, r)
    if B.shape[1] % len(kinds):
        raise LlamatuneError(f"{where}: layer {layer}: {B.shape[1]} rows cannot be split into {'/'.join(kinds)}")
    n = B.shape[1]
    return {f"blk.{layer}.{k}.weight": (np.ascontiguousarray(A, np.float32),
                                        np.ascontiguousarray(B[:, _kind_rows(n, len(kinds), i, rows)], np.float32))
            for i, k in enumerate(kinds)}


def to_peft(pairs: list[tuple[np.ndarray, np.ndarray]], rows: str = "stacked") -> tuple[np.ndarray, np.ndarray, int]:
    """(lora_A (E r', n_in), lora_B (n_out, r' E), r') of the kinds' pairs, their rows
    stacked or interleaved: one shared A where every kind has the same, else the
    block-diagonal pair of rank sum(r)."""
    if all(np.array_equal(pairs[0][0], a) for a, _ in pairs[1:]):
        A, B = pairs[0][0], np.concatenate([b for _, b in pairs], axis=1)
    else:
        A = np.concatenate([a for a, _ in pairs], axis=1)                    # (E, sum r, n_in)
        E, R = A.shape[:2]
        B = np.zeros((E, sum(b.shape[1] for _, b in pairs), R), np.float32)
        row = col = 0
        for _, b in pairs:
            B[:, row:row + b.shape[1], col:col + b.shape[2]] = b
            row, col = row + b.shape[1], col + b.shape[2]
    if rows == "interleaved":                     # stacked kind by kind -> alternate rows
        k = len(pairs)
        n = B.shape[1]
        B = B.reshape(B.shape[0], k, n // k, B.shape[2]).transpose(0, 2, 1, 3).reshape(B.shape)
    E, r = A.shape[:2]
    lora_a = A.reshape(E * r, A.shape[2])
    lora_b = B.transpose(1, 2, 0).reshape(B.shape[1], r * E)               # columns rank-major
    return np.ascontiguousarray(lora_a, np.float32), np.ascontiguousarray(lora_b, np.float32), r


def key(layer: int, path: str, nested: int) -> str:
    """The safetensors module of a parameter wrapped `nested` times more (base_layer)."""
    return f"model.layers.{layer}.{_module(path)}" + ".base_layer" * nested
