"""llama.cpp's 2023 training files (the formats; train/legacy.py makes llamatune
checkpoints of them): `finetune` and `train-text-from-scratch`
checkpoints (GGUF, training.type = finetune_lora | train_model) and the `ggla`
LoRA .bin (see /shared/FORMATS.md).

LoRA layouts. The 2023 finetune applied W' = W + mul_mat(a, b) with no scale
(ggml mul_mat(a, b) has ne [a.ne1, b.ne1]); a is ggml [r, n_in], b [r, n_out],
i.e. numpy a (n_in, r), b (n_out, r) and ΔW (n_out, n_in) = b·aᵀ. This holds for
every tensor once its base is read as (n_out, n_in): norms (C,) are (1, C) with
a (C, r), b (1, r) (b is stored 1-D when ggml drops its trailing 1), token_embd
and output (V, C) have a (C, r), b (V, r). Ours (adapter.py):
  - matrices, output and norms: A = aᵀ (r, n_in), B = b (n_out, r);
  - token_embd is flipped, ΔW = A·Bᵀ with A (V, r), B (C, r): A = b, B = a.
A ggla file holds the same tensors (names `<weight>.loraA/.loraB`) and was
applied as W + (alpha/r)·mul_mat(A, B) with its header's global r and alpha.

Scale. A GGUF adapter (and a llamatune run) scales each tensor by alpha/rank
with one alpha, while the 2023 tools used one scale c for every tensor whatever
its rank (c = 1 for checkpoints, alpha/r for ggla). We take alpha = c·r_main,
r_main the most common rank, so those tensors are copied exactly, and multiply
the B of tensors of any other rank (the rank-1 norms by default) by r/r_main,
which keeps every scale·B·A equal to the 2023 ΔW. Adam moments of a rescaled B
are divided by that factor (second moments by its square).

Adam moments. The 2023 optimizer kept one flat vector over the parameters in the
order ggml's forward graph visits them (`ggml_opt_adam` collects `gf->nodes`
flagged as parameters), each tensor in its 2023 layout. That order depends on
two things the checkpoint does not record: flash attention (on by default) and
the evaluation order (left-to-right or right-to-left, which the tools picked per
run by measuring memory). `param_orders` rebuilds the graph of
llama_build_lora_finetune_graphs / llama_build_train_graphs for all four cases;
`choose_order` keeps the one whose tensor boundaries best split the second
moments into homogeneous pieces (least within-tensor variance of log v), and
falls back to the 2023 default (flash, left-to-right) when they cannot be told
apart. Each chunk is then reshaped, transposed where our layout is, and
rescaled as the parameter it belongs to.
"""
from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LlamatuneError
from .gguf_io import GGUFFile
from .tensors import float_array

LEGACY_KINDS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up")
GGLA_MAGIC = 0x67676C61          # 'ggla' as a little-endian u32: the file starts with b"algg"
ORDER_LABELS = {(True, True): "flash attention, left-to-right", (True, False): "flash attention, right-to-left",
                (False, True): "no flash attention, left-to-right", (False, False): "no flash attention, right-to-left"}


def weight_names(n_layer: int) -> list[str]:
    """Base weights in the 2023 tensor order."""
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(n_layer):
        names += [f"blk.{i}.{k}.weight" for k in LEGACY_KINDS]
    return names


def kind_of(weight: str) -> str:
    return weight.split(".")[-2]


# --------------------------------------------------------------------------- 2023 files

def legacy_metadata(f: GGUFFile) -> dict:
    """The model metadata of a 2023 checkpoint (llama only), as ModelConfig.from_metadata reads it."""
    md = dict(f.metadata)
    if md.get("general.architecture") != "llama":
        raise LlamatuneError(f"{f.path}: 2023 checkpoint of architecture {md.get('general.architecture')!r}; "
                             "llama.cpp's 2023 training tools only wrote 'llama'")
    if md.get("training.type") == "finetune_lora":
        # finetune wrote rope.scale_linear un-inverted (the 2023 saver bug FORMATS.md notes)
        scale = f.get_float("llama.rope.scale_linear", 1.0) or 1.0
        md["llama.rope.scale_linear"] = 1.0 / scale
    if "tokenizer.ggml.tokens" not in md:
        for name in ("token_embd.weight.lora_b", "token_embd.weight"):
            if name in f.tensors:
                md["llama.vocab_size"] = f.tensors[name].shape[0]
                break
    return md


def read_ggla(path: Path) -> tuple[int, int, dict[str, np.ndarray]]:
    """(r, alpha, tensors by name in numpy order) of a ggla LoRA .bin."""
    data = path.read_bytes()
    if len(data) < 16:
        raise LlamatuneError(f"{path}: truncated ggla file ({len(data)} bytes)")
    magic, version, r, alpha = struct.unpack_from("<4I", data, 0)
    if magic != GGLA_MAGIC or version != 1:
        raise LlamatuneError(f"{path}: not a version-1 ggla LoRA file (magic {magic:#x}, version {version})")
    tensors: dict[str, np.ndarray] = {}
    off = 16
    while off < len(data):
        if off + 12 > len(data):
            raise LlamatuneError(f"{path}: truncated tensor header at byte {off}")
        n_dims, name_len, ttype = struct.unpack_from("<3I", data, off)
        off += 12
        if n_dims == 0 and name_len == 0:          # finetune's record for an absent tensor: header + padding only
            off += -off & 31
            continue
        if not 1 <= n_dims <= 4 or ttype not in (0, 1):
            raise LlamatuneError(f"{path}: bad tensor header at byte {off - 12} (n_dims {n_dims}, type {ttype}; "
                                 "ggla holds F32 or F16 tensors of 1 to 4 dimensions)")
        if off + 4 * n_dims + name_len > len(data):
            raise LlamatuneError(f"{path}: truncated tensor header at byte {off - 12}")
        ne = struct.unpack_from(f"<{n_dims}I", data, off)
        off += 4 * n_dims
        name = data[off:off + name_len].decode("utf-8", "replace")
        off += name_len
        if not name.isprintable() or min(ne) < 1:
            raise LlamatuneError(f"{path}: bad tensor header at byte {off - name_len - 4 * n_dims - 12} "
                                 f"(name {name[:80]!r}, dimensions {list(ne)})")
        off += -off & 31                           # data starts at a 32-byte file offset
        dtype = np.float32 if ttype == 0 else np.float16
        nbytes = math.prod(ne) * np.dtype(dtype).itemsize
        if off + nbytes > len(data):
            raise LlamatuneError(f"{path}: tensor '{name}' runs past the end of the file (truncated?)")
        arr = np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), math.prod(ne), off)
        if name in tensors:
            raise LlamatuneError(f"{path}: tensor '{name}' appears twice")
        if not np.isfinite(arr).all():
            raise LlamatuneError(f"{path}: tensor '{name}' holds non-finite values (inf or nan)")
        tensors[name] = arr.astype(np.float32).reshape(tuple(reversed(ne)))
        off += nbytes
    return r, alpha, tensors


# --------------------------------------------------------------------------- LoRA layouts

@dataclass
class LegacyPair:
    weight: str
    a: np.ndarray          # 2023 layout, numpy (n_in, r)
    b: np.ndarray          # 2023 layout, numpy (n_out, r)

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def legacy_pairs(shapes: dict[str, tuple[int, int]], tensors: dict[str, np.ndarray], suffixes: tuple[str, str],
                 source: str) -> dict[str, LegacyPair]:
    """Pair up and shape-check the 2023 LoRA tensors (`<weight><suffix a|b>`) against the base
    weights' (n_out, n_in) `shapes`, in the 2023 tensor order (norms (C,) count as (1, C))."""
    known = set(shapes)
    halves: dict[str, dict[int, np.ndarray]] = {}
    problems = []
    for name, arr in tensors.items():
        for i, suffix in enumerate(suffixes):
            if name.endswith(suffix) and name[:-len(suffix)] in known:
                halves.setdefault(name[:-len(suffix)], {})[i] = arr
                break
        else:
            problems.append(f"unexpected tensor '{name}'")
    pairs = {}
    for weight, (n_out, n_in) in shapes.items():
        h = halves.get(weight)
        if not h:
            continue
        if len(h) != 2:
            problems.append(f"'{weight}' has no {suffixes[1 - next(iter(h))]}")
            continue
        a, b = h[0], h[1]
        r = a.size // n_in if n_in else 0
        if r == 0 and a.size == 0 and b.size == 0:
            continue                                # rank 0: no adapter
        ok = a.size == n_in * r and b.size == n_out * r and r > 0
        # ggml drops trailing dimensions of 1 (norm b [r, 1] is stored as [r]), so compare without the 1s
        squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
        if not ok or squeeze(a.shape) != squeeze((n_in, r)) or squeeze(b.shape) != squeeze((n_out, r)):
            problems.append(f"'{weight}': a {a.shape} / b {b.shape} do not fit a base weight ({n_out}, {n_in})")
            continue
        pairs[weight] = LegacyPair(weight, a.reshape(n_in, r), b.reshape(n_out, r))
    if problems:
        raise LlamatuneError(f"{source}: " + "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else ""))
    if not pairs:
        raise LlamatuneError(f"{source}: holds no LoRA tensors")
    return pairs


@dataclass
class Mapping:
    """Where one 2023 LoRA tensor goes in our layout."""
    ours: str              # our parameter name, e.g. "blk.0.attn_q.weight.lora_a"
    shape: tuple[int, int]  # its 2023 numpy shape
    transpose: bool
    factor: float          # our value = 2023 value (transposed) * factor


def main_rank(pairs: dict[str, LegacyPair]) -> int:
    return Counter(p.rank for p in pairs.values()).most_common(1)[0][0]


def mappings(pairs: dict[str, LegacyPair]) -> dict[str, Mapping]:
    """2023 tensor name (`<weight>.lora_a/.lora_b`) -> Mapping (module docstring)."""
    r_main = main_rank(pairs)
    out = {}
    for w, p in pairs.items():
        k = p.rank / r_main
        if w == "token_embd.weight":
            out[w + ".lora_a"] = Mapping(w + ".lora_b", p.a.shape, False, k)
            out[w + ".lora_b"] = Mapping(w + ".lora_a", p.b.shape, False, 1.0)
        else:
            out[w + ".lora_a"] = Mapping(w + ".lora_a", p.a.shape, True, 1.0)
            out[w + ".lora_b"] = Mapping(w + ".lora_b", p.b.shape, False, k)
    return out


def convert_chunk(x: np.ndarray, m: Mapping, power: int = 1) -> np.ndarray:
    """A 2023 tensor in our layout (power 1), or its Adam moments (power -1 for m, -2 for v)."""
    y = x.reshape(m.shape)
    y = y.T if m.transpose else y
    if m.factor != 1.0:
        y = y * np.float32(m.factor ** power)
    return np.ascontiguousarray(y, np.float32)


def scale_note(pairs: dict[str, LegacyPair], alpha: float) -> str:
    """What the alpha choice did (module docstring, Scale)."""
    r_main = main_rank(pairs)
    other = sorted({(kind_of(w), p.rank) for w, p in pairs.items() if p.rank != r_main})
    note = f"alpha {alpha:g} with the most common rank {r_main} reproduces the 2023 scale"
    if other:
        note += ("; the lora_b of " + ", ".join(f"{k} (rank {r})" for k, r in other)
                 + f" was multiplied by rank/{r_main} so their scale·B·A is unchanged")
    return note


def to_ours(pairs: dict[str, LegacyPair], num: float,
            den: float) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(alpha, {weight: (A, B)}) for 2023 pairs applied with scale num/den."""
    maps = mappings(pairs)
    alpha = num * main_rank(pairs) / den
    out = {}
    for w, p in pairs.items():
        got = {maps[w + s].ours: convert_chunk(arr, maps[w + s]) for s, arr in ((".lora_a", p.a), (".lora_b", p.b))}
        out[w] = (got[w + ".lora_a"], got[w + ".lora_b"])
    return alpha, out


# --------------------------------------------------------------------------- graph parameter order

class _Op:
    """A node of the 2023 ggml graph: its sources in ggml's src order, and the parameter it is (if any)."""
    __slots__ = ("srcs", "param")

    def __init__(self, *srcs: "_Op", param: str | None = None):
        self.srcs, self.param = srcs, param


def _build_graph(n_layer: int, weight, flash: bool) -> _Op:
    """The loss of llama_build_lora_finetune_graphs / llama_build_train_graphs (same structure);
    `weight(name)` gives the op producing a base weight. Only the source order matters here."""
    tokens, targets, kq_pos = _Op(), _Op(), _Op()
    t00 = _Op(tokens)
    cur = _Op(weight("token_embd.weight"), t00)                   # t01 = get_rows(tok_embeddings, t00)
    for il in range(n_layer):
        w = lambda k: weight(f"blk.{il}.{k}.weight")  # noqa: E731
        t02 = _Op(cur)                                            # rms_norm
        t03 = _Op(w("attn_norm"))                                 # repeat(attention_norm, t02): src0 only
        t04 = _Op(t03, t02)                                       # mul
        t07 = _Op(_Op(_Op(w("attn_q"), t04)), kq_pos)             # rope(reshape(mul_mat(wq, t04)), KQ_pos)
        t10 = _Op(_Op(_Op(w("attn_k"), t04)), kq_pos)
        t11 = _Op(t04, w("attn_v"))                               # mul_mat(t04, wv)
        t13, t14, t15 = _Op(t07), _Op(t10), _Op(_Op(t11))         # permutes (t15 of reshape t12)
        if flash:
            t16 = _Op(t13, t14, t15)                              # flash_attn(q, k, v)
        else:
            t16_3 = _Op(_Op(_Op(_Op(t14, t13))))                  # soft_max(diag_mask(scale(mul_mat(k, q))))
            t16 = _Op(t15, t16_3)
        t19 = _Op(_Op(_Op(t16)))                                  # reshape(cont(permute))
        t21 = _Op(_Op(w("attn_output"), t19), cur)                # add(mul_mat(wo, t19), cur)
        t22 = _Op(t21)
        t24 = _Op(_Op(w("ffn_norm")), t22)                        # mul(repeat(ffn_norm), t22)
        t25 = _Op(w("ffn_up"), t24)
        t27 = _Op(_Op(w("ffn_gate"), t24))                        # silu(mul_mat(w1, t24))
        t29 = _Op(w("ffn_down"), _Op(t27, t25))
        cur = _Op(t29, t21)                                       # t30
    t33 = _Op(_Op(weight("output_norm.weight")), _Op(cur))       # mul(repeat(norm), rms_norm(cur))
    return _Op(_Op(_Op(weight("output.weight"), t33)), targets)   # cross_entropy(reshape(mul_mat(output, t33)))


def _visit(root: _Op, left_to_right: bool) -> list[str]:
    """Parameters in ggml_visit_parents order (iterative: real models are deeper than Python's stack)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            if node.param is not None:
                order.append(node.param)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        srcs = node.srcs if left_to_right else node.srcs[::-1]
        stack.extend((s, False) for s in reversed(srcs))
    return order


def param_orders(n_layer: int, lora: bool) -> dict[tuple[bool, bool], list[str]]:
    """(flash, left_to_right) -> 2023 parameter names in graph order."""
    def weight(name: str) -> _Op:
        if lora:       # add_to_f32(W, mul_mat(a, b)): the base W is no parameter
            return _Op(_Op(), _Op(_Op(param=name + ".lora_a"), _Op(param=name + ".lora_b")))
        return _Op(param=name)

    return {key: _visit(_build_graph(n_layer, weight, key[0]), key[1]) for key in ORDER_LABELS}


def choose_order(orders: dict[tuple[bool, bool], list[str]], sizes: dict[str, int],
                 v: np.ndarray) -> tuple[tuple[bool, bool], str]:
    """The candidate order whose tensor boundaries fit the second moments best (module docstring).
    Returns (key, how it was chosen)."""
    logv = np.full(v.shape, np.nan, np.float64)
    pos = v > 0
    logv[pos] = np.log(v[pos].astype(np.float64))
    scores = {}
    for key, names in orders.items():
        sse, off = 0.0, 0
        for n in names:
            x = logv[off:off + sizes.get(n, 0)]
            off += sizes.get(n, 0)
            x = x[~np.isnan(x)]
            if x.size > 1:
                sse += float(((x - x.mean()) ** 2).sum())
        scores[key] = sse
    best = min(scores.values())
    tied = [k for k in ORDER_LABELS if scores[k] <= best + 1e-9 * max(1.0, abs(best))]
    if len(tied) == 1:
        return tied[0], "detected from the moments"
    if len(tied) == len(scores):
        return tied[0], "assumed: the moments do not tell the orders apart"
    return tied[0], f"assumed: the moments fit {len(tied)} orders equally well"


def flat_moments(order: list[str], sizes: dict[str, int], flat: np.ndarray) -> dict[str, np.ndarray]:
    """Split a 2023 flat moment vector into per-tensor chunks."""
    out, off = {}, 0
    for n in order:
        out[n] = flat[off:off + sizes.get(n, 0)]
        off += sizes.get(n, 0)
    return out


def split_moments(f: GGUFFile, sizes: dict[str, int], lora: bool,
                  n_layer: int) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None, str]:
    """Per-tensor (first, second) Adam moment chunks of a 2023 checkpoint, in its own layouts, and a note."""
    kind = f.get("optimizer.type")
    m_t, v_t = f.tensors.get("optimizer.adam.first_moments"), f.tensors.get("optimizer.adam.second_moments")
    if kind != "adam" or m_t is None or v_t is None:
        return None, None, (f"its optimizer state ({kind or 'none'}) has no Adam moments to carry over: "
                            "they start at zero")
    total = sum(sizes.values())
    m = float_array(f.path, m_t).reshape(-1)
    v = float_array(f.path, v_t).reshape(-1)
    if m.size != total or v.size != total:
        raise LlamatuneError(f"{f.path}: Adam moments hold {m.size}/{v.size} values but the parameters have {total}")
    orders = param_orders(n_layer, lora)
    key, how = choose_order(orders, sizes, v)
    note = f"Adam moments split in the 2023 graph order '{ORDER_LABELS[key]}' ({how})"
    return flat_moments(orders[key], sizes, m), flat_moments(orders[key], sizes, v), note
