"""Hugging Face PEFT LoRA adapters <-> llama.cpp GGUF adapters, without torch.

A PEFT adapter is a directory with `adapter_config.json` and
`adapter_model.safetensors`. Tensor names and layouts, against today's GGUF
adapter (see adapter.py):

  base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   (r, n_in)   = blk.N.attn_q.weight.lora_a
  base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   (n_out, r)  = blk.N.attn_q.weight.lora_b
  k_proj/v_proj/o_proj -> attn_k/attn_v/attn_output; mlp.gate_proj/up_proj/down_proj -> ffn_gate/ffn_up/ffn_down;
  lm_head -> output.weight;
  base_model.model.model.embed_tokens.lora_embedding_A  (r, V)  -> token_embd.weight.lora_a = its transpose (V, r)
  base_model.model.model.embed_tokens.lora_embedding_B  (C, r)  -> token_embd.weight.lora_b, unchanged

The layer module names are the architecture's (`PeftNames`, built by the commands from
models/arch.Arch.peft_modules, so this module knows no model): llama/qwen2 as above;
phi3's fused self_attn.qkv_proj -> attn_qkv and mlp.gate_up_proj -> ffn_up hold the same
rows as llama.cpp's tensors (q | k | v, gate | up) and map as they are. A PEFT module the
architecture does not have (q_proj of a phi3, whose HF model has only qkv_proj) is refused.
PEFT's LoRA on fused 3-D expert parameters (`target_parameters`) maps to llama.cpp's
per-expert pairs in peft_experts.py.

Llama q/k rows: llama.cpp's convert_hf_to_gguf.py reorders the rows of q_proj
and k_proj for its rope layout (`permute`, per head: HF row i and i + head_dim/2
become GGUF rows 2i and 2i+1). An adapter's B rows follow the same reordering
(A is untouched): `permute_rows` going to GGUF, `unpermute_rows` coming back.
Qwen2 keeps the HF order.

Scale: PEFT applies lora_alpha/r per module (`rank_pattern`/`alpha_pattern`
override per module; `use_rslora` divides by sqrt(r)); a GGUF adapter has one
alpha and uses alpha/r with each tensor's own rank. Ranks carry over as they
are. When the modules' alphas differ, the GGUF alpha is the most common one
and the B of every other module is rescaled so that scale·B·A is unchanged
(exact for inference; the description lists them). Norm adapters (which PEFT
cannot hold, and llama.cpp skips at run time) are left out of PEFT output.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import LlamatuneError
from . import peft_experts as X
from .adapter import LoraAdapter, is_norm

PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "A", ".lora_embedding_B": "B"}
_NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}

Heads = tuple[int, int]      # (n_head, n_head_kv) of the base model, for the llama q/k row order


@dataclass(frozen=True)
class PeftNames:
    """One architecture's PEFT names (from its declaration, models/arch.Arch.peft_modules):
    the module under `model.layers.N.` of each llama.cpp layer kind, e.g. attn_q ->
    self_attn.q_proj, or phi3's fused attn_qkv -> self_attn.qkv_proj (same rows, q | k | v,
    so a fused adapter maps as it is); and whether q/k rows are reordered (llama)."""
    arch: str
    layer: dict[str, str]
    permute_qk: bool = False
    experts: X.Experts = ()           # fused 3-D expert parameters (peft_experts.py)
    # kind -> ("rows" of B or "cols" of A, p): the converter's order of that kind is HF's
    # indexed by p (gguf = hf[p]); a kind -> None: reordered by head counts no base gave
    orders: dict[str, tuple[str, np.ndarray] | None] = field(default_factory=dict)

    @property
    def modules(self) -> str:
        """The module names this architecture has, for error messages."""
        return ", ".join(m.rsplit(".", 1)[-1] for m in self.layer.values()) + ", embed_tokens, lm_head"


# --------------------------------------------------------------------------- names and row order

def hf_module(gguf_name: str, names: PeftNames) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj` (None when PEFT has no such module)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens"
    if gguf_name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in names.layer:
        return f"model.layers.{m.group(1)}.{names.layer[m.group(2)]}"
    return None


def gguf_weight(module: str, names: PeftNames) -> str | None:
    """The inverse of `hf_module`."""
    if module == "model.embed_tokens":
        return "token_embd.weight"
    if module == "lm_head":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.([\w.]+)", module)
    back = {v: k for k, v in names.layer.items()}
    if m and m.group(2) in back:
        return f"blk.{m.group(1)}.{back[m.group(2)]}.weight"
    return None


def _qk_heads(name: str, names: PeftNames, heads: Heads | None) -> int | None:
    """Head count whose row order must change for this weight, or None."""
    if not names.permute_qk or not name.endswith((".attn_q.weight", ".attn_k.weight")):
        return None
    if heads is None:
        raise LlamatuneError("--model-base is required: llama attn_q/attn_k adapters need the base model's head "
                             "counts to convert between the Hugging Face and GGUF row orders")
    return heads[0] if name.endswith(".attn_q.weight") else heads[1]


def _check_rows(w: np.ndarray, n_head: int, name: str) -> None:
    if w.shape[0] % (2 * n_head):
        raise LlamatuneError(f"{name}: {w.shape[0]} rows cannot be split into {n_head} heads of even size "
                             "(does --model-base match this adapter?)")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of q/k (llama.cpp convert_hf_to_gguf.py `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF -> HF row order of q/k: the inverse of `permute_rows`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reordered(name: str, a: np.ndarray, b: np.ndarray, names: PeftNames, to_gguf: bool):
    """(a, b) in the GGUF order (to_gguf) or back in HF's, where the converter reorders the
    kind's rows or columns (PeftNames.orders; qwen35's value heads)."""
    kind = name.split(".")[-2]
    if kind not in names.orders:
        return a, b
    if names.orders[kind] is None:
        raise LlamatuneError(f"--model-base is required: {names.arch}'s {kind} adapters are reordered by the "
                             "converter as the base model's head counts say")
    axis, p = names.orders[kind]
    p = p if to_gguf else np.argsort(p)
    return (a, b[p]) if axis == "rows" else (a[:, p], b)


# --------------------------------------------------------------------------- safetensors

def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as float32 (F64/F32/F16/BF16; numpy has no bfloat16,
    so the file is parsed here rather than with safetensors.numpy)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if len(raw) < 8 or n > len(raw) - 8:
        raise LlamatuneError(f"{path}: not a safetensors file (header of {n} bytes in a file of {len(raw)})")
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise LlamatuneError(f"{path}: not a safetensors file ({str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise LlamatuneError(f"{path}: not a safetensors file (the header is not a JSON object)")
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, lo, hi = _entry(path, name, info, len(raw) - base)
        buf = raw[base + lo:base + hi]
        itemsize = 2 if dtype == "BF16" else np.dtype(_NP_DTYPES.get(dtype, np.uint8)).itemsize
        if len(buf) != math.prod(shape) * itemsize:
            raise LlamatuneError(f"{path}: tensor '{name}' data does not match its shape {shape} (truncated file?)")
        if dtype == "BF16":
            arr = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _NP_DTYPES:
            arr = np.frombuffer(buf, np.dtype(_NP_DTYPES[dtype]).newbyteorder("<")).astype(np.float32)
        else:
            raise LlamatuneError(f"{path}: tensor '{name}' has dtype {dtype}; only F32, F16, BF16 and F64 "
                                 "are supported")
        if not np.isfinite(arr).all():
            raise LlamatuneError(f"{path}: tensor '{name}' holds non-finite values (inf or nan)")
        out[name] = arr.reshape(shape)
    return out


def _entry(path: Path, name: str, info, n_data: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, lo, hi) of one safetensors header entry, checked against the data size."""
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) for o in info["data_offsets"]))
    if not ok or not name.isprintable():
        raise LlamatuneError(f"{path}: tensor {name[:80]!r} has a malformed header entry {str(info)[:80]}")
    lo, hi = info["data_offsets"]
    if not 0 <= lo <= hi <= n_data:
        raise LlamatuneError(f"{path}: tensor '{name}' data offsets [{lo}, {hi}] are outside the {n_data} data bytes")
    return info["dtype"], tuple(info["shape"]), lo, hi


# --------------------------------------------------------------------------- PEFT -> GGUF

def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module name or its dotted suffix."""
    for key, value in (pattern or {}).items():
        try:
            hit = re.fullmatch(rf"(?:.*\.)?(?:{key})", module)
        except re.error:
            hit = module == key or module.endswith("." + key)
        if hit:
            return value
    return default


def _read_config(path: Path) -> dict:
    """adapter_config.json of a PEFT LoRA directory, its values checked."""
    try:
        cfg = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LlamatuneError(f"{path}: cannot read adapter_config.json ({e})") from None
    where = f"{path}: PEFT adapter"
    if not isinstance(cfg, dict):
        raise LlamatuneError(f"{path}: adapter_config.json is not a JSON object")
    for key in ("lora_alpha", "r"):
        if key in cfg and (isinstance(cfg[key], bool) or not isinstance(cfg[key], (int, float))
                           or not math.isfinite(cfg[key])):
            raise LlamatuneError(f"{path}: adapter_config.json '{key}' is {str(cfg[key])[:40]!r}, expected a number")
    for key in ("alpha_pattern", "rank_pattern"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise LlamatuneError(f"{path}: adapter_config.json '{key}' is not a JSON object")
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise LlamatuneError(f"{where} has peft_type {cfg.get('peft_type')!r}; only LORA adapters can be converted")
    for flag, why in (("use_dora", "DoRA magnitude vectors"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layouts")):
        if cfg.get(flag):
            raise LlamatuneError(f"{where} uses {flag}: {why} have no GGUF adapter equivalent")
    return cfg


def _halves(tensors: dict[str, np.ndarray], where: str) -> dict[str, dict[str, np.ndarray]]:
    """The safetensors' LoRA tensors by module: {"A": lora_A, "B": lora_B}."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    unknown = []
    for key, arr in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        for suffix, half in _SUFFIXES.items():
            if name.endswith(suffix):
                halves.setdefault(name[:-len(suffix)], {})[half] = arr
                break
        else:
            unknown.append(key)
    if unknown:
        raise LlamatuneError(f"{where} has tensors that are not LoRA A/B weights: {unknown[:4]} (full weights from "
                             "modules_to_save, biases or DoRA vectors cannot go into a GGUF adapter)")
    if not halves:
        raise LlamatuneError(f"{where} holds no LoRA tensors")
    return halves


def _alpha(cfg: dict, module: str, r: int, where: str) -> float:
    """The alpha a GGUF adapter needs for a module's scale: PEFT's alpha_m / r (rslora:
    alpha_m / sqrt(r)) == alpha / r; alpha_m from alpha_pattern or lora_alpha."""
    alpha_m = _pattern_value(cfg.get("alpha_pattern"), module, float(cfg.get("lora_alpha", 8)))  # PEFT's default 8
    if isinstance(alpha_m, bool) or not isinstance(alpha_m, (int, float)) or not math.isfinite(alpha_m):
        raise LlamatuneError(f"{where}: alpha_pattern gives module '{module}' the alpha {str(alpha_m)[:40]!r}, "
                             "expected a number")
    return float(alpha_m) * math.sqrt(r) if cfg.get("use_rslora") else float(alpha_m)


def _expert_pairs(cfg: dict, module: str, found: tuple[int, str, int], h: dict, names: PeftNames, where: str) -> dict:
    """The GGUF pairs (with their alphas) of one PEFT expert module (peft_experts.py)."""
    layer, _, nested = found
    params = X.targeted(layer, names.experts, list(cfg.get("target_parameters") or []))
    if nested >= len(params):
        raise LlamatuneError(f"{where}: module '{module}' matches none of target_parameters "
                             f"{cfg.get('target_parameters')} (this model's: {', '.join(p for _, p, _ in names.experts)})")
    kinds, param, rows = params[len(params) - 1 - nested]
    full = f"model.layers.{layer}.{param}"
    r = _pattern_value(cfg.get("rank_pattern"), full, cfg.get("r", 8))
    if isinstance(r, float) and r.is_integer():
        r = int(r)
    if isinstance(r, bool) or not isinstance(r, int):
        raise LlamatuneError(f"{where}: the rank of '{full}' is {str(r)[:40]!r}, expected an integer")
    alpha_eq = _alpha(cfg, full, r, where)
    return {w: (a, b, alpha_eq) for w, (a, b) in X.from_peft(h["A"], h["B"], r, kinds, rows, layer, where).items()}


def read_peft(path: Path, names: PeftNames, heads: Heads | None) -> tuple[LoraAdapter, list[str], str]:
    """A PEFT LoRA directory as a GGUF-layout adapter for `names.arch`. Returns (adapter, notes, base model name)."""
    cfg, where = _read_config(path), f"{path}: PEFT adapter"
    halves = _halves(read_safetensors(path / "adapter_model.safetensors"), where)
    pairs: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for module, h in halves.items():
        if len(h) != 2:
            raise LlamatuneError(f"{where}: module '{module}' has only lora_{next(iter(h))}")
        found = X.expert_module(module, names.experts) if names.experts else None
        if found is not None:
            pairs.update(_expert_pairs(cfg, module, found, h, names, where))
            continue
        weight = gguf_weight(module, names)
        if weight is None:
            raise LlamatuneError(f"{where}: module '{module}' has no llama.cpp tensor in a {names.arch} model "
                                 f"(its modules: {names.modules})")
        a, b = h["A"], h["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LlamatuneError(f"{where}: module '{module}' has lora_A {a.shape} and lora_B {b.shape}, not a "
                                 "rank-r pair")
        alpha_eq = _alpha(cfg, module, a.shape[0], where)
        if weight == "token_embd.weight":
            a = a.T                                   # (V, r): llama.cpp's flipped embedding layout
        else:
            n_head = _qk_heads(weight, names, heads)
            if n_head:
                _check_rows(b, n_head, module)
                b = permute_rows(b, n_head)
            a, b = reordered(weight, a, b, names, to_gguf=True)
        pairs[weight] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32), alpha_eq)

    alpha = Counter(p[2] for p in pairs.values()).most_common(1)[0][0]
    if alpha == 0:
        raise LlamatuneError(f"{where} has lora_alpha 0 (a zero scale): nothing to convert")
    notes, rescaled = [], []
    adapter = LoraAdapter(names.arch, alpha)
    for weight, (a, b, alpha_eq) in pairs.items():
        if alpha_eq != alpha:
            b = (b * np.float32(alpha_eq / alpha)).astype(np.float32)
            rescaled.append(weight)
        adapter.pairs[weight] = (a, b)
    if rescaled:
        notes.append(f"{len(rescaled)} module(s) had their own alpha (alpha_pattern/use_rslora); their lora_b was "
                     f"rescaled so that alpha {alpha:g}/r gives the same scale·B·A ({', '.join(rescaled[:3])}"
                     f"{', ...' if len(rescaled) > 3 else ''})")
    return adapter, notes, str(cfg.get("base_model_name_or_path") or "")


# --------------------------------------------------------------------------- GGUF -> PEFT

def _expert_tensors(experts: dict, names: PeftNames, adapter: LoraAdapter, base: tuple[int, float], tensors: dict,
                    rank_pattern: dict, alpha_pattern: dict) -> list[str]:
    """The PEFT tensors of the adapter's 3-D expert pairs, added to `tensors` (with their
    ranks and alphas where not the config's `base` (r, alpha)); returns target_parameters."""
    by_param: dict[tuple[int, str], dict[str, tuple]] = {}
    owner = {k: (kinds, path, rows) for kinds, path, rows in names.experts for k in kinds}
    for name, pair in experts.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if not m or m.group(2) not in owner:
            raise LlamatuneError(f"adapter tensor '{name}' has no Hugging Face PEFT parameter in a {names.arch} model")
        by_param.setdefault((int(m.group(1)), owner[m.group(2)][1]), {})[m.group(2)] = pair
    used = [path for _, path, _ in names.experts if any(p == path for _, p in by_param)]
    for (layer, path), got in sorted(by_param.items()):
        kinds, rows = next((k, rw) for k, p, rw in names.experts if p == path)
        ranks = {b.shape[-1] for _, b in got.values()}
        if len(ranks) > 1:
            raise LlamatuneError(f"layer {layer}: {', '.join(kinds)} have different ranks {sorted(ranks)}; PEFT's "
                                 f"{path} holds them as one pair")
        first = next(iter(got.values()))
        pairs = [got[k] if k in got else (first[0], np.zeros_like(first[1])) for k in kinds]   # an absent kind: B = 0
        lora_a, lora_b, r_param = X.to_peft(pairs, rows)
        module = X.key(layer, path, len(used) - 1 - used.index(path))
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_a, lora_b
        r_kind = ranks.pop()
        alpha_param = (float(adapter.alpha) if adapter.alpha else float(r_kind)) * r_param / r_kind   # alpha / r kept
        full = f"model.layers.{layer}.{path}"
        if r_param != base[0]:
            rank_pattern[full] = int(r_param)
        if alpha_param != base[1]:
            alpha_pattern[full] = alpha_param
    return sorted(used)


def peft_files(adapter: LoraAdapter, names: PeftNames, heads: Heads | None,
               base_name: str = "") -> tuple[dict, dict[str, np.ndarray], list[str]]:
    """(adapter_config, safetensors tensors, notes) for a GGUF-layout adapter of `names.arch`."""
    notes = []
    norms = [n for n in adapter.pairs if is_norm(n)]
    if norms:
        notes.append(f"{len(norms)} norm adapter(s) left out: PEFT has no LoRA for norm weights "
                     "(llama.cpp ignores them at run time as well)")
    entries, experts = [], {}
    for name, (a, b) in adapter.pairs.items():
        if is_norm(name):
            continue
        if a.ndim == 3:
            experts[name] = (a, b)
            continue
        module = hf_module(name, names)
        if module is None:
            raise LlamatuneError(f"adapter tensor '{name}' has no Hugging Face PEFT module in a {names.arch} model")
        entries.append((name, module, a, b, b.shape[-1]))
    if not entries and not experts:
        raise LlamatuneError("the adapter has no tensors PEFT can hold (only norm adapters)")

    r = Counter([e[4] for e in entries] + [b.shape[-1] for _, b in experts.values()]).most_common(1)[0][0]
    alpha = float(adapter.alpha) if adapter.alpha else float(r)
    tensors: dict[str, np.ndarray] = {}
    rank_pattern, alpha_pattern = {}, {}
    for name, module, a, b, rank in entries:
        if rank != r:
            rank_pattern[module] = rank
            if not adapter.alpha:              # alpha 0: llama.cpp scale is 1 for every tensor
                alpha_pattern[module] = float(rank)
        if name == "token_embd.weight":
            tensors[f"{PREFIX}{module}.lora_embedding_A"] = np.ascontiguousarray(a.T, np.float32)
            tensors[f"{PREFIX}{module}.lora_embedding_B"] = np.ascontiguousarray(b, np.float32)
            continue
        n_head = _qk_heads(name, names, heads)
        if n_head:
            _check_rows(b, n_head, name)
            b = unpermute_rows(b, n_head)
        a, b = reordered(name, a, b, names, to_gguf=False)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)

    targets = _expert_tensors(experts, names, adapter, (r, alpha), tensors, rank_pattern, alpha_pattern)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name or None,
        "r": int(r), "lora_alpha": alpha, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "target_modules": sorted({e[1].rsplit(".", 1)[-1] for e in entries}) or None,
        **({"target_parameters": targets} if targets else {}),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
    }
    return config, tensors, notes
